"""fuse_ort_block: tanh gelu -> FastGelu, LayerNorm(Add) -> SkipLayerNormalization, outputs unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from kvexport.passes import FuseOrtBlockPass

E = 8


def _block_model(dtype: type = np.float32) -> onnx.ModelProto:
    """h = LN(x + r); y = gelu_tanh(h @ W + b); outputs y and the residual sum x + r."""
    h = onnx.helper
    rng = np.random.default_rng(0)
    consts = {
        "gamma": rng.normal(size=E), "beta": rng.normal(size=E), "W": rng.normal(size=(E, 2 * E)),
        "b": rng.normal(size=2 * E), "half": 0.5, "three": 3.0, "coef": 0.044715,
        "sqrt2pi": 0.7978845608028654, "one": 1.0,
    }
    nodes = [
        h.make_node("Add", ["x", "r"], ["sum"]),
        h.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["normed"], axis=-1, epsilon=1e-5),
        h.make_node("MatMul", ["normed", "W"], ["mm"]),
        h.make_node("Add", ["mm", "b"], ["pre"]),
        h.make_node("Mul", ["pre", "half"], ["halfx"]),
        h.make_node("Pow", ["pre", "three"], ["cube"]),
        h.make_node("Mul", ["cube", "coef"], ["scaled_cube"]),
        h.make_node("Add", ["pre", "scaled_cube"], ["inner0"]),
        h.make_node("Mul", ["inner0", "sqrt2pi"], ["inner"]),
        h.make_node("Tanh", ["inner"], ["t"]),
        h.make_node("Add", ["t", "one"], ["t1"]),
        h.make_node("Mul", ["halfx", "t1"], ["y"]),
    ]
    initializers = [onnx.numpy_helper.from_array(np.array(v, dtype), k) for k, v in consts.items()]
    element = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    shape = ["batch", "sequence", E]
    graph = h.make_graph(
        nodes,
        "block",
        [h.make_tensor_value_info(n, element, shape) for n in ("x", "r")],
        [
            h.make_tensor_value_info("y", element, None),
            h.make_tensor_value_info("sum", element, shape),
        ],
        initializers,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10)


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_gelu_and_layernorm_fuse_with_bias_absorbed_and_outputs_unchanged() -> None:
    proto = _block_model()
    model = ir.serde.deserialize_model(proto)
    # the residual sum is a graph output here; the rule must keep it (SkipLayerNorm's output 3)
    fuse = FuseOrtBlockPass()
    assert fuse(model).modified
    assert {rule: n for rule, n in fuse.counts.items() if n} == {"FastGeluRule": 1, "SkipLayerNormRule": 1}
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    ops = [(n.domain, n.op_type) for n in model.graph]
    assert ops == [
        ("com.microsoft", "SkipLayerNormalization"),
        ("", "MatMul"),
        ("com.microsoft", "FastGelu"),
    ]
    fast_gelu = model.graph[2]
    assert [v.name for v in fast_gelu.inputs if v is not None][1] == "b"  # the c_fc bias moved in
    rng = np.random.default_rng(1)
    feeds = {n: rng.normal(size=(2, 3, E)).astype(np.float32) for n in ("x", "r")}
    fused = ir.serde.serialize_model(model)
    for got, want in zip(_run(fused, feeds), _run(proto, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_cpu_graph_keeps_its_residual_add_and_layernorm() -> None:
    """``skip_layer_norm=False`` (the ort-cpu exports): gelu still fuses, LayerNorm(Add) stays two ops."""
    proto = _block_model()
    model = ir.serde.deserialize_model(proto)
    fuse = FuseOrtBlockPass(skip_layer_norm=False)
    assert fuse(model).modified
    assert {rule: n for rule, n in fuse.counts.items() if n} == {"FastGeluRule": 1}
    assert "SkipLayerNormRule" not in fuse.counts
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    assert [(n.domain, n.op_type) for n in model.graph] == [
        ("", "Add"),
        ("", "LayerNormalization"),
        ("", "MatMul"),
        ("com.microsoft", "FastGelu"),
    ]
    rng = np.random.default_rng(1)
    feeds = {n: rng.normal(size=(2, 3, E)).astype(np.float32) for n in ("x", "r")}
    for got, want in zip(_run(ir.serde.serialize_model(model), feeds), _run(proto, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_other_constants_are_not_mistaken_for_gelu() -> None:
    proto = _block_model()
    for initializer in proto.graph.initializer:
        if initializer.name == "coef":
            initializer.CopyFrom(onnx.numpy_helper.from_array(np.array(0.05, np.float32), "coef"))
    model = ir.serde.deserialize_model(proto)
    fuse = FuseOrtBlockPass()
    fuse(model)
    assert fuse.counts["FastGeluRule"] == 0
    assert sum(n.op_type == "Tanh" for n in model.graph) == 1


def test_fp16_constants_are_gelu_to_fp16_precision() -> None:
    # fp16 stores 0.044715 as 0.04471 and sqrt(2/pi) as 0.7979: still gelu (the ort-cuda default)
    model = ir.serde.deserialize_model(_block_model(np.float16))
    fuse = FuseOrtBlockPass()
    fuse(model)
    assert {rule: n for rule, n in fuse.counts.items() if n} == {"FastGeluRule": 1, "SkipLayerNormRule": 1}


def test_fp16_near_miss_is_still_not_gelu() -> None:
    proto = _block_model(np.float16)
    for initializer in proto.graph.initializer:
        if initializer.name == "coef":  # one fp16 step away from 0.04471
            near = np.nextafter(np.float16(0.044715), np.float16(1))
            near = np.nextafter(near, np.float16(1))
            initializer.CopyFrom(onnx.numpy_helper.from_array(np.array(near, np.float16), "coef"))
    fuse = FuseOrtBlockPass()
    fuse(ir.serde.deserialize_model(proto))
    assert fuse.counts["FastGeluRule"] == 0


def _rms_block_model() -> onnx.ModelProto:
    """A Llama-style residual step: s = x + r; y = RMSNorm(s) * w, as the dynamo exporter writes RMSNorm."""
    h = onnx.helper
    rng = np.random.default_rng(0)
    initializers = [
        onnx.numpy_helper.from_array(rng.normal(size=E).astype(np.float32), "w"),
        onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        onnx.numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes"),
    ]
    nodes = [
        h.make_node("Add", ["x", "r"], ["sum"]),
        h.make_node("Pow", ["sum", "two"], ["squared"]),
        h.make_node("ReduceMean", ["squared", "axes"], ["mean"], keepdims=1, noop_with_empty_axes=0),
        h.make_node("Add", ["mean", "eps"], ["shifted"]),
        h.make_node("Sqrt", ["shifted"], ["root"]),
        h.make_node("Reciprocal", ["root"], ["inverse"]),
        h.make_node("Mul", ["sum", "inverse"], ["normed"]),
        h.make_node("Mul", ["w", "normed"], ["y"]),
    ]
    shape = ["batch", "sequence", E]
    graph = h.make_graph(
        nodes,
        "rms",
        [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, shape) for n in ("x", "r")],
        [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, shape) for n in ("y", "sum")],
        initializers,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10)


def test_rmsnorm_after_a_residual_add_becomes_skip_simplified_layernorm() -> None:
    proto = _rms_block_model()
    model = ir.serde.deserialize_model(proto)
    fuse = FuseOrtBlockPass()
    assert fuse(model).modified
    assert fuse.counts["SkipSimplifiedLayerNormalization"] == 1
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    assert [(n.domain, n.op_type) for n in model.graph] == [("com.microsoft", "SkipSimplifiedLayerNormalization")]
    rng = np.random.default_rng(2)
    feeds = {n: rng.normal(size=(2, 3, E)).astype(np.float32) for n in ("x", "r")}
    for got, want in zip(_run(ir.serde.serialize_model(model), feeds), _run(proto, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
