"""fold_shapes: computed Reshape targets become constants; Shape nodes stay few and per graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from kvexport.passes import FoldShapesPass
from kvexport.passes.fold_shapes import count_ops
from kvexport.testing import export_foreign
from tests.conftest import TINY, write_config


def _split_heads_model() -> onnx.ModelProto:
    """Y = Transpose(Reshape(X, Concat(Shape(X)[0], Shape(X)[1], 3, 16))); K^T via a 3-D reshape."""
    h = onnx.helper
    nodes = [
        h.make_node("Shape", ["X"], ["shape"]),
        h.make_node("Gather", ["shape", "i0"], ["batch"], axis=0),
        h.make_node("Gather", ["shape", "i1"], ["seq"], axis=0),
        h.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        h.make_node("Unsqueeze", ["seq", "axes0"], ["seq1"]),
        h.make_node("Concat", ["batch1", "seq1", "heads_dim"], ["target"], axis=0),
        h.make_node("Reshape", ["X", "target"], ["split"]),
        h.make_node("Transpose", ["split"], ["Y"], perm=[0, 2, 1, 3]),
        # K^T the way torch sometimes lowers k.transpose(-2, -1): merge, swap, split
        h.make_node("Shape", ["Y"], ["yshape"]),
        h.make_node("Slice", ["yshape", "s2", "s4"], ["last2"]),
        h.make_node("Slice", ["yshape", "s0", "s2"], ["first2"]),
        h.make_node("Concat", ["minus1", "last2"], ["merged_shape"], axis=0),
        h.make_node("Reshape", ["Y", "merged_shape"], ["merged"]),
        h.make_node("Transpose", ["merged"], ["swapped"], perm=[0, 2, 1]),
        h.make_node("Slice", ["yshape", "s3", "s4"], ["d"]),
        h.make_node("Slice", ["yshape", "s2", "s3"], ["s"]),
        h.make_node("Concat", ["first2", "d", "s"], ["split_shape"], axis=0),
        h.make_node("Reshape", ["swapped", "split_shape"], ["KT"]),
    ]
    ints = {"i0": 0, "i1": 1}
    arrays = {
        "axes0": [0], "heads_dim": [3, 16], "minus1": [-1],
        "s0": [0], "s2": [2], "s3": [3], "s4": [4],
    }
    initializers = [onnx.numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    initializers += [onnx.numpy_helper.from_array(np.array(v, np.int64), k) for k, v in arrays.items()]
    graph = h.make_graph(
        nodes,
        "split-heads",
        [h.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["batch", "sequence", 48])],
        [
            h.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None),
            h.make_tensor_value_info("KT", onnx.TensorProto.FLOAT, None),
        ],
        initializers,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10)


def _run(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})


def test_shape_chains_fold_to_constant_targets_and_outputs_are_unchanged() -> None:
    proto = _split_heads_model()
    model = ir.serde.deserialize_model(proto)
    fold = FoldShapesPass()
    assert fold(model).modified
    assert count_ops(model, "Shape") == 0
    assert fold.counts["ReshapeToConstantShape"] == 1
    assert fold.counts["ReshapeTransposeReshapeToTranspose"] == 1
    reshape = next(node for node in model.graph if node.op_type == "Reshape")
    target = reshape.inputs[1]
    assert target is not None and target.const_value is not None
    assert target.const_value.numpy().tolist() == [0, 0, 3, 16]  # batch, sequence stay dynamic
    assert [n.op_type for n in model.graph] == ["Reshape", "Transpose", "Transpose"]
    assert list(model.graph[2].attributes["perm"].as_ints()) == [0, 1, 3, 2]
    folded = ir.serde.serialize_model(model)
    for batch, sequence in ((1, 1), (2, 7), (3, 5)):
        x = np.random.default_rng(batch).normal(size=(batch, sequence, 48)).astype(np.float32)
        for got, want in zip(_run(folded, x), _run(proto, x), strict=True):
            np.testing.assert_array_equal(got, want)


def test_graph_without_shape_work_is_not_modified() -> None:
    h = onnx.helper
    graph = h.make_graph(
        [h.make_node("Relu", ["X"], ["Y"])],
        "plain",
        [h.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["b", 4])],
        [h.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["b", 4])],
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10))
    assert not FoldShapesPass()(model).modified
    assert [n.op_type for n in model.graph] == ["Relu"]


@pytest.fixture(scope="module")
def torchscript_decode_by_depth(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """TorchScript decode graphs (Optimum names, no passes) of the tiny model at 2 and 4 layers."""
    graphs = {}
    for layers in (2, 4):
        base = tmp_path_factory.mktemp(f"ts-{layers}")
        config = write_config(base, {**TINY, "n_layer": layers})
        graphs[layers] = export_foreign(base / "graphs", config, seed=3, style="optimum") / "decode.onnx"
    return graphs


def test_torchscript_decode_shape_count_is_small_and_does_not_grow_with_depth(
    torchscript_decode_by_depth: dict[int, Path],
) -> None:
    shapes = {}
    for layers, path in torchscript_decode_by_depth.items():
        model = ir.load(path)
        before = count_ops(model, "Shape")
        FoldShapesPass()(model)
        shapes[layers] = count_ops(model, "Shape")
        assert before > 20 * layers  # what the tracer leaves: dozens per layer
    assert shapes[2] == shapes[4] <= 4


def test_dynamo_decode_shape_count_is_at_most_four(tiny_export: Path) -> None:
    model = ir.load(tiny_export / "decode.onnx")  # the export pipeline already folded it
    assert count_ops(model, "Shape") <= 4


def _feeds(session: ort.InferenceSession, past_length: int) -> dict[str, np.ndarray]:
    """A left-padded batch of 2 for a decode graph: row 0 has 3 padded positions."""
    rng = np.random.default_rng(5)
    mask = np.ones((2, past_length + 1), np.int64)
    mask[0, :3] = 0
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, TINY["vocab_size"], (2, 1)),
        "attention_mask": mask,
        "position_ids": (mask.sum(-1, keepdims=True) - 1).astype(np.int64),
    }
    for value in session.get_inputs():
        if value.name not in feeds:  # the cache, whatever its names
            heads, head_dim = TINY["n_head"], TINY["n_embd"] // TINY["n_head"]
            feeds[value.name] = rng.normal(size=(2, heads, past_length, head_dim)).astype(np.float32)
    return feeds


def test_decode_mask_becomes_the_padding_mask_and_outputs_are_unchanged(tmp_path: Path) -> None:
    config = write_config(tmp_path, TINY)
    graphs = export_foreign(tmp_path / "graphs", config, seed=4, style="optimum", exporter="dynamo")
    raw = onnx.load(graphs / "decode.onnx")
    model = ir.serde.deserialize_model(raw)
    fold = FoldShapesPass()
    fold(model)
    # one shared mask for all layers; the causal/padding chain over shapes is gone
    assert fold.counts["DecodeMaskFromAttentionMask"] == 1
    ops = {node.op_type for node in model.graph}
    assert {"Range", "GatherND", "LessOrEqual"}.isdisjoint(ops)
    assert count_ops(model, "Shape") == 0
    again = FoldShapesPass()
    again(model)  # the mask is already the padding mask: nothing to do, nothing to break
    assert again.counts["DecodeMaskFromAttentionMask"] == 0
    folded = ir.serde.serialize_model(model)
    sessions = [ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]) for p in (raw, folded)]
    feeds = _feeds(sessions[0], past_length=5)
    for want, got in zip(sessions[0].run(None, feeds), sessions[1].run(None, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    prefill = ir.load(graphs / "prefill.onnx")
    fold = FoldShapesPass()
    fold(prefill)
    assert fold.counts["DecodeMaskFromAttentionMask"] == 0  # prompts need the causal part
