"""transposed_weight_gemm: MatMul(X, Transpose(W)) -> Gemm(X, W, transB=1), outputs unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from kvexport.passes import TransposedWeightGemmPass


def _model(x_shape: list[int]) -> onnx.ModelProto:
    weight = onnx.numpy_helper.from_array(
        np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32), "W"
    )
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
            onnx.helper.make_node("MatMul", ["X", "Wt"], ["Y"]),
        ],
        "head",
        [onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, x_shape)],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)],
        [weight],
    )
    return onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10
    )


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})[0]


def test_rank2_matmul_with_transposed_constant_becomes_gemm() -> None:
    proto = _model(["rows", 8])
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    expected = _run(proto, x)
    model = ir.from_proto(proto)
    graph_pass = TransposedWeightGemmPass()
    result = graph_pass(model)
    assert result.modified and graph_pass.counts == {"MatMulTransposedWeightToGemm": 1, "TiedTransposedCopyToGemm": 0}
    ops = [node.op_type for node in model.graph]
    assert ops == ["Gemm"]
    gemm = next(iter(model.graph))
    assert gemm.attributes["transB"].as_int() == 1
    assert (
        gemm.inputs[1] is not None and gemm.inputs[1].name == "W"
    )  # the stored weight, read in place
    np.testing.assert_allclose(_run(ir.to_proto(model), x), expected, rtol=1e-6, atol=1e-6)


def test_rank3_activation_is_left_alone() -> None:
    model = ir.from_proto(_model([2, "rows", 8]))
    graph_pass = TransposedWeightGemmPass()
    result = graph_pass(model)
    assert not result.modified and graph_pass.counts == {"MatMulTransposedWeightToGemm": 0, "TiedTransposedCopyToGemm": 0}
    assert [node.op_type for node in model.graph] == ["Transpose", "MatMul"]


def test_stored_transposed_copy_of_an_embedding_is_read_from_the_embedding() -> None:
    """Optimum's tied head: MatMul(X[b, s, E], WT) with WT a stored copy of the embedding's transpose."""
    table = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Gather", ["W", "ids"], ["X"]),
            onnx.helper.make_node("MatMul", ["X", "WT"], ["logits"]),
        ],
        "tied",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["b", "s"])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["b", "s", 16])],
        [onnx.numpy_helper.from_array(table, "W"), onnx.numpy_helper.from_array(table.T.copy(), "WT")],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    ids = np.array([[1, 5, 15], [0, 2, 3]], np.int64)
    run = lambda p: ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]  # noqa: E731
    expected = run(proto)
    model = ir.from_proto(proto)
    graph_pass = TransposedWeightGemmPass()
    assert graph_pass(model).modified and graph_pass.counts["TiedTransposedCopyToGemm"] == 1
    gemm = next(node for node in model.graph if node.op_type == "Gemm")
    assert gemm.inputs[1] is not None and gemm.inputs[1].name == "W"
    assert not any(node.op_type == "MatMul" for node in model.graph)
    assert [v.name for v in model.graph.outputs] == ["logits"]
    np.testing.assert_allclose(run(ir.to_proto(model)), expected, rtol=1e-6, atol=1e-6)
