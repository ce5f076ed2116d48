"""Graphs that third-party tools really made (tests/data/foreign, see FIXTURES.json) fuse, fold and keep their outputs.

The fixtures come from ``scripts/build_foreign_fixtures.py``: Optimum's one-graph
decoder (transformers 4.57), ONNX Runtime's transformers optimizer on it, and a
TorchScript decode graph with eager attention. Each graph is driven by its own IO names;
the rewritten one must give the same outputs on a left-padded batch, over the prompt
(with an empty past) and several decode steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from kvexport.cli import main
from kvexport.passes.fold_shapes import count_ops
from kvexport.passes.fuse_attention import count_attention_ops
from kvexport.testing import cache_by_slot, left_padded_batch, run_single_graph

FOREIGN = Path(__file__).parent / "data" / "foreign"
PROMPTS = [[5, 17, 300, 42, 9, 2047], [88, 1024, 7]]
TOKENS = [[11, 12], [13, 14], [15, 16], [2000, 1]]
LAYERS = {"optimum-l2": 2, "optimum-l3": 3, "ortopt-l3": 3, "torchscript-decode-l3": 3}
# the Llama-style families' fixtures (tests/test_foreign_families.py): Optimum's unfused, the builder's fused
FAMILY_LAYERS = {"optimum-llama": 2, "optimum-qwen3": 2, "optimum-phi3": 2}
FUSED_BY_THE_TOOL = {"genai-llama": 2, "genai-qwen3": 2}
FUSED_OP = {"onnx": "Attention", "ort": "MultiHeadAttention"}


def _rewrite(source: Path, output: Path, *extra: str) -> dict[str, object]:
    result = CliRunner().invoke(main, ["rewrite", str(source), str(output), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _assert_same_real_outputs(
    original: list[dict[str, np.ndarray]], rewritten: list[dict[str, np.ndarray]], prefilled: bool
) -> None:
    """Logits and cache agree within 1e-5 wherever a real token is (left padding excluded).

    Padding rows see no real key; the fused ops give them a different (unused) value
    than the decomposition's NaN guard, and later layers' cache at those positions
    follows. Real tokens never attend to them.
    """
    _, mask, _ = left_padded_batch(PROMPTS)
    real_prompt = mask.astype(bool)
    assert len(original) == len(rewritten) == len(TOKENS) + (1 if prefilled else 0)
    for step, (before, after) in enumerate(zip(original, rewritten, strict=True)):
        grown = step + (0 if prefilled else 1)
        keys = np.concatenate([real_prompt, np.ones((len(PROMPTS), grown), bool)], axis=1)
        logits_before, logits_after = before["logits"], after["logits"]
        if prefilled and step == 0:
            logits_before, logits_after = logits_before[real_prompt], logits_after[real_prompt]
        np.testing.assert_allclose(logits_after, logits_before, atol=1e-5, rtol=0)
        cache_before, cache_after = cache_by_slot(before), cache_by_slot(after)
        assert cache_before.keys() == cache_after.keys()
        for slot, array in cache_before.items():
            real_before = array.transpose(0, 2, 1, 3)[keys]
            real_after = cache_after[slot].transpose(0, 2, 1, 3)[keys]
            np.testing.assert_allclose(real_after, real_before, atol=1e-5, rtol=0, err_msg=f"step {step} {slot}")


def test_fixtures_record_the_tools_that_made_them() -> None:
    record = json.loads((FOREIGN / "FIXTURES.json").read_text())
    assert set(record) == {f"{name}.onnx" for name in [*LAYERS, *FAMILY_LAYERS, *FUSED_BY_THE_TOOL]}
    assert record["optimum-l3.onnx"]["versions"]["transformers"].startswith("4.57.")
    assert record["optimum-l3.onnx"]["versions"]["optimum-onnx"] == "0.1.0"
    assert record["genai-llama.onnx"]["versions"]["onnxruntime-genai"] == "0.18.0"
    for name, layers in {**LAYERS, **FAMILY_LAYERS}.items():
        model = ir.load(FOREIGN / f"{name}.onnx")
        assert count_attention_ops(model) == 0
        assert count_ops(model, "Softmax") == layers  # nothing fused them
    for name, layers in FUSED_BY_THE_TOOL.items():
        model = ir.load(FOREIGN / f"{name}.onnx")
        assert count_attention_ops(model) == layers and count_ops(model, "Softmax") == 0


@pytest.mark.parametrize("target", ["onnx", "ort"])
@pytest.mark.parametrize("fixture", ["optimum-l2", "optimum-l3", "ortopt-l3"])
def test_one_graph_decoders_fuse_and_keep_their_outputs(fixture: str, target: str, tmp_path: Path) -> None:
    source = FOREIGN / f"{fixture}.onnx"
    output = tmp_path / "rewritten.onnx"
    report = _rewrite(source, output, "--attention", target)
    model = ir.load(output)
    layers = LAYERS[fixture]
    assert count_attention_ops(model) == layers
    assert sum(1 for node in model.graph if node.op_type == FUSED_OP[target]) == layers
    assert count_ops(model, "Softmax") == 0
    fuse = next(p for p in report["passes"] if p["name"] == "fuse_attention")  # type: ignore[union-attr]
    assert fuse["counts"][f"{'Onnx' if target == 'onnx' else 'Ort'}AttentionWithPast"] == layers
    original = run_single_graph(source, PROMPTS, TOKENS)
    rewritten = run_single_graph(output, PROMPTS, TOKENS)
    _assert_same_real_outputs(original, rewritten, prefilled=True)


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_torchscript_eager_decode_graph_fuses_and_keeps_its_outputs(target: str, tmp_path: Path) -> None:
    """The eager form: MatMul -> Div(sqrt(D)) -> causal Where over the sliced bias buffer -> Add(mask)."""
    source = FOREIGN / "torchscript-decode-l3.onnx"
    output = tmp_path / "rewritten.onnx"
    _rewrite(source, output, "--attention", target)
    model = ir.load(output)
    assert count_attention_ops(model) == 3
    assert count_ops(model, "Softmax") == 0
    # The prompt's cache comes from Optimum's graph of the same checkpoint.
    prompt = run_single_graph(FOREIGN / "optimum-l3.onnx", PROMPTS, [])
    past = cache_by_slot(prompt[0])
    original = run_single_graph(source, PROMPTS, TOKENS, past=past)
    rewritten = run_single_graph(output, PROMPTS, TOKENS, past=past)
    _assert_same_real_outputs(original, rewritten, prefilled=False)


@pytest.mark.parametrize("attention", ["unfused", "ort"])
def test_shape_nodes_left_do_not_grow_with_depth(attention: str, tmp_path: Path) -> None:
    left = {}
    for fixture in ("optimum-l2", "optimum-l3"):
        report = _rewrite(FOREIGN / f"{fixture}.onnx", tmp_path / f"{fixture}.onnx", "--attention", attention)
        before = report["passes"][0]["shape_nodes_before"]  # type: ignore[index]
        left[fixture] = count_ops(ir.load(tmp_path / f"{fixture}.onnx"), "Shape")
        assert left[fixture] < before / 10
    assert left["optimum-l2"] == left["optimum-l3"]


def test_a_rule_that_does_not_match_says_why(tmp_path: Path) -> None:
    """A scale that is not a constant stops the fusion, and --explain names it."""
    model = ir.load(FOREIGN / "torchscript-decode-l3.onnx")
    divisor = ir.Value(name="scale_divisor", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
    model.graph.inputs.append(divisor)
    for node in model.graph:
        if node.op_type == "Div" and "/attn/" in (node.name or ""):
            node.replace_input_with(1, divisor)
    source = tmp_path / "scaled-by-input.onnx"
    ir.save(model, source)
    result = CliRunner().invoke(main, ["rewrite", str(source), str(tmp_path / "out.onnx"), "--attention", "ort", "--explain"])
    assert result.exit_code == 2, result.output  # asked to fuse, left unfused: refused, nothing written
    assert not (tmp_path / "out.onnx").exists()
    [line] = result.stderr.strip().splitlines()
    assert "3 attention subgraph(s) left unfused (closest rule OrtAttentionWithPast: check failed" in line
    assert "the attention scale is not a scalar constant" in line


def _rescaled(form: str, path: Path) -> Path:
    """The TorchScript graph with its ``Div(scores, c)`` written another way eager code writes it.

    ``mul_after``: ``Mul(scores, 1/c)``; ``query_before``: ``MatMul(Mul(q, 1/c), k^T)``.
    """
    model = ir.load(FOREIGN / "torchscript-decode-l3.onnx")
    graph = model.graph
    for div in [node for node in graph if node.op_type == "Div" and "/attn/" in (node.name or "")]:
        scores, divisor = div.inputs
        assert scores is not None and divisor is not None
        product = scores.producer()
        assert product is not None and product.op_type == "MatMul"
        inverse = ir.Value(
            name=f"{div.name}.inverse",
            const_value=ir.tensor(np.array(1.0 / np.sqrt(8.0), np.float32)),
            type=ir.TensorType(ir.DataType.FLOAT),
            shape=ir.Shape([]),
        )
        graph.register_initializer(inverse)
        if form == "mul_after":
            mul = ir.node("Mul", [scores, inverse])
            graph.insert_before(div, mul)
            div.outputs[0].replace_all_uses_with(mul.outputs[0])
        else:
            query = product.inputs[0]
            assert query is not None
            mul = ir.node("Mul", [query, inverse])
            graph.insert_before(product, mul)
            product.replace_input_with(0, mul.outputs[0])
            div.outputs[0].replace_all_uses_with(scores)
        graph.remove(div, safe=True)
    ir.save(model, path)
    return path


@pytest.mark.parametrize("form", ["mul_after", "query_before"])
def test_other_eager_scalings_fuse_with_the_same_scale(form: str, tmp_path: Path) -> None:
    source = _rescaled(form, tmp_path / f"{form}.onnx")
    output = tmp_path / "rewritten.onnx"
    _rewrite(source, output, "--attention", "ort")
    model = ir.load(output)
    assert count_attention_ops(model) == 3 and count_ops(model, "Softmax") == 0
    scales = [node.attributes["scale"].as_float() for node in model.graph if node.op_type == "MultiHeadAttention"]
    assert scales == pytest.approx([1 / np.sqrt(8.0)] * 3)
    prompt = run_single_graph(FOREIGN / "optimum-l3.onnx", PROMPTS, [])
    past = cache_by_slot(prompt[0])
    original = run_single_graph(source, PROMPTS, TOKENS, past=past)
    rewritten = run_single_graph(output, PROMPTS, TOKENS, past=past)
    _assert_same_real_outputs(original, rewritten, prefilled=False)
