"""#35: the Llama-style families' graphs other tools made, rewritten and imported with fused attention.

Sources: Optimum's one-graph exports and onnxruntime-genai's model builder graphs (fixtures
built by ``scripts/build_foreign_fixtures.py``, each tool in an environment of its own) and
plain ``torch.onnx.export(dynamo=True)`` graphs of the Hugging Face model with its cache as
IO, made here. Each rewritten graph must have one
GroupQueryAttention per layer, no Softmax left, and the source graph's numbers over a
prefill and decode steps, batch 1 and a left-padded batch 2; each import must pass verify
(PyTorch, step by step) and serve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from kvexport.cli import main
from kvexport.testing import export_foreign, run_single_graph

from .conftest import write_config
from .test_families import FAMILY_CONFIGS

FOREIGN = Path(__file__).parent / "data" / "foreign"
OPTIMUM_FAMILIES = ("llama", "qwen3", "phi3")
PROMPTS = [[5, 17, 42, 7, 99], [8, 3, 250]]  # the second row is left-padded
TOKENS = [[11, 12], [13, 14], [15, 16]]


def _ops(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in ir.load(path).graph:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _rewrite(source: Path, output: Path, *extra: str) -> None:
    result = CliRunner().invoke(main, ["rewrite", str(source), str(output), *extra])
    assert result.exit_code == 0, result.output


def _assert_same_steps(source: list[dict[str, np.ndarray]], rewritten: list[dict[str, np.ndarray]], pad: int) -> None:
    """Each step's logits and presents agree; the padded row's pad positions are no one's business."""
    assert len(source) == len(rewritten)
    for before, after in zip(source, rewritten, strict=True):
        np.testing.assert_allclose(after["logits"][:, -1], before["logits"][:, -1], atol=2e-5, rtol=1e-4)
        presents = [name for name in before if name != "logits"]
        assert presents
        for name in presents:
            canonical = name.replace("present_key_values", "present")
            np.testing.assert_allclose(after[canonical][0], before[name][0], atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(after[canonical][1, :, pad:], before[name][1, :, pad:], atol=2e-5, rtol=1e-4)


def _assert_generator_keeps_pytorchs_tokens(directory: Path, checkpoint: Path) -> None:
    """The Generator (in-place: the prefill graph runs the decode steps too) gives PyTorch's greedy tokens, left-padded."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvexport import Generator
    from kvexport.testing import left_padded_batch

    rows = np.random.default_rng(1).integers(0, 1000, (2, 20)).tolist()
    ids, mask, _ = left_padded_batch([rows[0], rows[1][:13]])  # prompts longer than a few tokens, one left-padded
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=5, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]  # fmt: skip
    got = Generator(directory).generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=-1)[:, ids.shape[1]:]
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("family", OPTIMUM_FAMILIES)
def test_optimum_graph_rewrites_to_one_gqa_per_layer_with_the_same_numbers(family: str, tmp_path: Path) -> None:
    source = FOREIGN / f"optimum-{family}.onnx"
    output = tmp_path / "rewritten.onnx"
    _rewrite(source, output, "--attention", "ort")
    ops = _ops(output)
    layers = json.loads((FOREIGN / f"checkpoint-{family}" / "config.json").read_text())["num_hidden_layers"]
    assert ops.get("GroupQueryAttention") == layers and "Softmax" not in ops
    assert ops.get("SkipSimplifiedLayerNormalization") == 2 * layers  # RMSNorm fused, residual Adds folded in
    assert ops.get("RotaryEmbedding") == 2 * layers and "Neg" not in ops  # rotate_half fused, queries and keys
    cache = ir.load(output).graph.inputs[3]
    assert cache.name == "past.0.key" and cache.shape is not None and cache.shape[1] == 2  # KV heads unexpanded
    pad = len(PROMPTS[0]) - len(PROMPTS[1])
    _assert_same_steps(run_single_graph(source, PROMPTS, TOKENS), run_single_graph(output, PROMPTS, TOKENS), pad)


@pytest.mark.parametrize("family", OPTIMUM_FAMILIES)
def test_optimum_graph_imports_to_a_directory_that_verifies_and_serves(family: str, tmp_path: Path) -> None:
    source = tmp_path / "optimum"
    source.mkdir()
    shutil.copy(FOREIGN / f"optimum-{family}.onnx", source / "model.onnx")
    checkpoint = FOREIGN / f"checkpoint-{family}"
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(checkpoint / name, source / name)
    out = tmp_path / "imported"
    done = CliRunner().invoke(main, ["import", str(source), "--out", str(out), "--model", str(checkpoint), "--attention", "ort"])
    assert done.exit_code == 0, done.output
    manifest = json.loads((out / "kvexport.json").read_text())
    assert manifest["cache"]["layout"] == "shared-buffer"
    assert manifest["model"]["family"] == {"llama": "llama", "qwen3": "qwen3", "phi3": "phi3"}[family]
    for graph in ("prefill", "decode"):
        assert _ops(out / f"{graph}.onnx").get("GroupQueryAttention") == 2
    verified = CliRunner().invoke(main, ["verify", str(out)])
    assert verified.exit_code == 0, verified.output
    assert verified.output.strip().splitlines()[-1].startswith("PASS")
    _assert_generator_keeps_pytorchs_tokens(out, checkpoint)
    if family == "llama":  # served: greedy tokens as PyTorch's from the checkpoint
        import torch
        from fastapi.testclient import TestClient
        from transformers import AutoModelForCausalLM

        from kvexport.serving.app import create_app
        from kvexport.serving.engine import Engine

        prompt = [5, 17, 42]
        model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None)[0, 3:]
        with Engine(out, slots=2, max_context=64) as engine:
            client = TestClient(create_app(engine))
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == want.tolist()


@pytest.mark.parametrize(("graph", "gated"), [("optimum-llama.onnx", True), ("optimum-l2.onnx", False)])
def test_rewrite_per_channel_picks_the_recipe_by_the_graphs_mlp(tmp_path: Path, graph: str, gated: bool) -> None:
    """``kvexport rewrite --per-channel`` has no family to go by: a graph with a gated MLP (the Llama's) gets
    the gated families' recipe, 8-bit uint8 weights with the down projections' input rotated by Hadamard
    blocks (float MatMuls), as its export would;
    GPT-2's gets its own, 7-bit int8 weights and every product per channel."""
    output = tmp_path / "rewritten.onnx"
    _rewrite(FOREIGN / graph, output, "--attention", "ort", "--quantize", "int8", "--per-channel")
    model = ir.load(output)
    products = [node for node in model.graph if node.op_type == "MatMulIntegerToFloat"]
    assert products
    weights = {node.inputs[1].const_value.dtype for node in products}
    assert weights == ({ir.DataType.UINT8} if gated else {ir.DataType.INT8})
    assert not [node for node in model.graph if node.op_type == "MatMulNBits"]
    rotations = [node for node in model.graph if node.op_type == "MatMul" and node.inputs[1].name.startswith("kvexport.hadamard_")]
    layers = json.loads((FOREIGN / f"checkpoint-{graph.removeprefix('optimum-').removesuffix('.onnx')}" / "config.json").read_text())
    assert len(rotations) == (layers.get("num_hidden_layers", layers.get("n_layer")) if gated else 0)  # one down projection a layer
    # per-channel int8 runs on CPU: LayerNorm(Add) stays two ops there, as in ort-cpu exports (the RMSNorm pair fuses)
    ops = {node.op_type for node in model.graph}
    assert "SkipLayerNormalization" not in ops
    assert ("SkipSimplifiedLayerNormalization" if gated else "LayerNormalization") in ops


@pytest.mark.parametrize("per_channel", [False, True])
def test_an_int8_import_keeps_the_last_position_head_and_verifies(tmp_path: Path, per_channel: bool) -> None:
    """``--quantize int8`` on an ort import is the blocks (Q8_0's arithmetic); ``--per-channel`` the Llama's recipe
    (the down projections rotated first): either way the prefill runs its head on the last position only, logits [batch, 1, V]."""
    source = tmp_path / "optimum"
    source.mkdir()
    shutil.copy(FOREIGN / "optimum-llama.onnx", source / "model.onnx")
    checkpoint = FOREIGN / "checkpoint-llama"
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(checkpoint / name, source / name)
    out = tmp_path / "imported"
    flags = ["--per-channel"] if per_channel else []
    done = CliRunner().invoke(
        main, ["import", str(source), "--out", str(out), "--model", str(checkpoint), "--attention", "ort", "--quantize", "int8", *flags]
    )
    assert done.exit_code == 0, done.output
    manifest = json.loads((out / "kvexport.json").read_text())
    assert manifest["quantization"]["per_channel"] is per_channel
    if per_channel:
        assert manifest["quantization"]["gated_blocks"] is False and manifest["quantization"]["gated_rotation"] == 64
    else:
        assert manifest["quantization"]["block_size"] == 32 and manifest["quantization"]["accuracy_level"] == 4
    assert manifest["all_logits"] is False
    prefill = onnx.load(str(out / "prefill.onnx"), load_external_data=False)
    logits = next(o for o in prefill.graph.output if o.name == "logits")
    assert [d.dim_value or d.dim_param for d in logits.type.tensor_type.shape.dim][1] == 1
    ops = _ops(out / "prefill.onnx")
    if per_channel:
        assert "MatMulNBits" not in ops and ops.get("MatMulIntegerToFloat", 0) > 0
    else:
        assert "MatMulIntegerToFloat" not in ops and ops.get("MatMulNBits", 0) > 0
    rotations = [node for node in prefill.graph.node if node.op_type == "MatMul" and node.input[1].startswith("kvexport.hadamard_")]
    assert len(rotations) == (2 if per_channel else 0)  # the 2 layers' rotations before their down projections
    verified = CliRunner().invoke(main, ["verify", str(out)])
    assert verified.exit_code == 0, verified.output


def test_a_sliding_window_from_the_config_reaches_the_fused_op(tmp_path: Path) -> None:
    """Over the in-place cache the exporter's mask is replaced by padding: the window must move into the op."""
    source, checkpoint = tmp_path / "optimum", tmp_path / "checkpoint"
    shutil.copytree(FOREIGN / "checkpoint-phi3", checkpoint)
    source.mkdir()
    shutil.copy(FOREIGN / "optimum-phi3.onnx", source / "model.onnx")
    for directory in (source, checkpoint):
        config = json.loads((FOREIGN / "checkpoint-phi3" / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "sliding_window": 4}))
    shutil.copy(checkpoint / "tokenizer.json", source / "tokenizer.json")
    out = tmp_path / "imported"
    done = CliRunner().invoke(main, ["import", str(source), "--out", str(out), "--model", str(checkpoint), "--attention", "ort"])
    assert done.exit_code == 0, done.output
    windows = [n.attributes.get_int("local_window_size") for n in ir.load(out / "decode.onnx").graph if n.op_type == "GroupQueryAttention"]
    assert windows == [4, 4]
    verified = CliRunner().invoke(main, ["verify", str(out)])  # PyTorch windows too; its prompts pass 4 positions
    assert verified.exit_code == 0, verified.output


@pytest.fixture(scope="module", params=[*((name, 18) for name in sorted(FAMILY_CONFIGS)), ("llama", 23)], ids=lambda p: f"{p[0]}-opset{p[1]}")
def dynamo_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name, opset = request.param
    settings = {**FAMILY_CONFIGS[name], "sliding_window": None} if name == "mistral" else FAMILY_CONFIGS[name]
    config = write_config(tmp_path_factory.mktemp(f"config-{name}"), settings)
    out = tmp_path_factory.mktemp(f"dynamo-{name}-{opset}")
    return name, export_foreign(out, config, seed=3, style="optimum", exporter="dynamo", opset=opset)


def test_torch_dynamo_graphs_rewrite_to_one_gqa_per_layer_with_the_same_numbers(
    dynamo_export: tuple[str, Path], tmp_path: Path
) -> None:
    name, graphs = dynamo_export
    layers = FAMILY_CONFIGS[name]["num_hidden_layers"]
    pad = len(PROMPTS[0]) - len(PROMPTS[1])
    rewritten = {}
    for graph in ("prefill", "decode"):
        rewritten[graph] = tmp_path / f"{graph}.onnx"
        _rewrite(graphs / f"{graph}.onnx", rewritten[graph], "--attention", "ort")
        ops = _ops(rewritten[graph])
        assert ops.get("GroupQueryAttention") == layers and "Softmax" not in ops, ops
        assert ops.get("SkipSimplifiedLayerNormalization") == 2 * layers, ops
        assert ops.get("RotaryEmbedding") == 2 * layers and "Neg" not in ops, ops  # ours at 18, the standard op at 23
    prompt = run_single_graph(graphs / "prefill.onnx", PROMPTS, [])
    prompt_after = run_single_graph(rewritten["prefill"], PROMPTS, [])
    _assert_same_steps(prompt, prompt_after, pad)
    from kvexport.testing import cache_by_slot

    cache = cache_by_slot(prompt[0])
    _assert_same_steps(
        run_single_graph(graphs / "decode.onnx", PROMPTS, TOKENS, past=cache),
        run_single_graph(rewritten["decode"], PROMPTS, TOKENS, past=cache),
        pad,
    )


def test_an_unknown_family_is_one_line(tmp_path: Path) -> None:
    source = tmp_path / "optimum"
    source.mkdir()
    shutil.copy(FOREIGN / "optimum-llama.onnx", source / "model.onnx")
    config = json.loads((FOREIGN / "checkpoint-llama" / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    out = tmp_path / "imported"
    done = CliRunner().invoke(main, ["import", str(source), "--out", str(out), "--attention", "ort"])
    assert done.exit_code == 2
    assert done.stderr.strip().splitlines() == [
        f"Error: {source / 'config.json'}: model_type 'gemma' is not a family kvexport exports; "
        "known: gpt2, llama, mistral, phi3, qwen2, qwen3"
    ]
    assert not out.exists()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_genai_builder_graph_imports_with_positions_and_lengths_as_kvexport_computes_them(family: str, tmp_path: Path) -> None:
    """The builder's GQA rotates by the cache index and counts the mask's ones: import makes it verify left-padded."""
    source = tmp_path / "genai"
    source.mkdir()
    shutil.copy(FOREIGN / f"genai-{family}.onnx", source / "model.onnx")
    (source / "genai_config.json").write_text(json.dumps({"model": {"type": family}}))
    out = tmp_path / "imported"
    refused = CliRunner().invoke(main, ["import", str(source), "--out", str(out), "--attention", "ort"])
    assert refused.exit_code == 2 and not out.exists()
    assert refused.stderr.strip().splitlines() == [
        f"Error: {source}: onnxruntime-genai's export has no config.json; pass --model CHECKPOINT (the checkpoint it was "
        "built from: its config names the family, and verify compares with it)"
    ]
    checkpoint = FOREIGN / f"checkpoint-{family}"
    done = CliRunner().invoke(main, ["import", str(source), "--out", str(out), "--model", str(checkpoint), "--attention", "ort"])
    assert done.exit_code == 0, done.output
    manifest = json.loads((out / "kvexport.json").read_text())
    assert manifest["export"]["converted"]["attention_converted"] == 2
    for graph in ("prefill", "decode"):
        model = ir.load(out / f"{graph}.onnx")
        names = [value.name for value in model.graph.inputs]
        assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
        assert names[3:7] == ["past.0.key", "past.0.value", "past.1.key", "past.1.value"]  # the builder lists keys first
        attention = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
        assert len(attention) == 2 and all(n.attributes.get_int("do_rotary") == 0 for n in attention)
        assert sum(1 for n in model.graph if n.op_type == "RotaryEmbedding") == 4
    verified = CliRunner().invoke(main, ["verify", str(out)])  # left-padded and ragged rows included
    assert verified.exit_code == 0, verified.output
    _assert_generator_keeps_pytorchs_tokens(out, checkpoint)
