"""cleanup: dead nodes and duplicate initializers go, outputs stay."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from kvexport.passes import CleanupPass


def test_cleanup_removes_dead_nodes_and_duplicate_weights() -> None:
    weight = np.arange(8, dtype=np.float32)
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Add", ["X", "A"], ["Y0"]),
            onnx.helper.make_node("Mul", ["Y0", "B"], ["Y"]),  # B has the same bytes as A
            onnx.helper.make_node("Neg", ["X"], ["unused"]),  # dead
        ],
        "g",
        [onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [8])],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [8])],
        [
            onnx.numpy_helper.from_array(weight, "A"),
            onnx.numpy_helper.from_array(weight.copy(), "B"),
        ],
    )
    proto = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10
    )
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    expected = ort.InferenceSession(
        proto.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, {"X": x})
    model = ir.from_proto(proto)
    graph_pass = CleanupPass()
    assert graph_pass(model).modified
    assert graph_pass.counts == {"nodes_removed": 1, "initializers_removed": 1}
    assert [node.op_type for node in model.graph] == ["Add", "Mul"]
    got = ort.InferenceSession(
        ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, {"X": x})
    np.testing.assert_array_equal(got[0], expected[0])
