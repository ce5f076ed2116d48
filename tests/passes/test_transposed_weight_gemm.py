"""transposed_weight_gemm: MatMul(X, Transpose(W)) -> Gemm(X, W, transB=1), outputs unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from passes import TransposedWeightGemmPass


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
    assert result.modified and graph_pass.counts == {"MatMulTransposedWeightToGemm": 1}
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
    assert not result.modified and graph_pass.counts == {"MatMulTransposedWeightToGemm": 0}
    assert [node.op_type for node in model.graph] == ["Transpose", "MatMul"]
