"""quantize_weights: MatMul/Gemm/Gather -> MatMulNBits/GatherBlockQuantized, tied bytes shared."""

from __future__ import annotations

import platform

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from kvexport.errors import ProviderError
from kvexport.passes import QuantizationConfig, QuantizeWeightsPass, SignedChannelsPass
from kvexport.runtime.session import cpu_flags, open_session, signed_int8_weights

V, C, HIDDEN = 67, 64, 128  # odd vocab; K = 64 and 128 are multiples of the block sizes


def _tied_decoder() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Gather(E, ids) -> MatMul(W1) -> MatMul(W2) -> Gemm(E, transB=1): a tied-head toy."""
    rng = np.random.default_rng(0)
    weights = {
        "E": rng.standard_normal((V, C)).astype(np.float32),
        "W1": (rng.standard_normal((C, HIDDEN)) / 8).astype(np.float32),
        "W2": (rng.standard_normal((HIDDEN, C)) / 8).astype(np.float32),
    }
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Gather", ["E", "ids"], ["embedded"]),
            onnx.helper.make_node("MatMul", ["embedded", "W1"], ["h1"]),
            onnx.helper.make_node("MatMul", ["h1", "W2"], ["h2"]),
            onnx.helper.make_node("Gemm", ["h2", "E"], ["logits"], transB=1),
        ],
        "toy",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["n"])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["n", V])],
        [onnx.numpy_helper.from_array(a, n) for n, a in weights.items()],
    )
    proto = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10
    )
    return proto, weights


def _run(model: onnx.ModelProto | ir.Model, ids: np.ndarray) -> np.ndarray:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"ids": ids})[0]


def _block_dequantized(weight_k_by_n: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Symmetric block quantization written out in numpy, the independent reference.

    4 bits: ONNX Runtime's rule (the signed extreme maps to -8); 8 bits: llama.cpp Q8_0's
    (``max |w| / 127``, codes in [-127, 127]).
    """
    k, n = weight_k_by_n.shape
    blocks = weight_k_by_n.T.reshape(n, k // block, block)
    if bits == 8:
        step = np.abs(blocks).max(-1, keepdims=True) / 127
        step = np.where(step == 0, 1, step)
        return (np.clip(np.round(blocks / step), -127, 127) * step).reshape(n, k).T
    # ORT picks the signed extreme of each block, so that value maps to -2^(bits-1) exactly
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
    scale = extreme / -(2 ** (bits - 1))
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    quantized = np.clip(np.round(blocks / np.where(scale == 0, 1, scale)), low, high)
    return (quantized * scale).reshape(n, k).T


@pytest.mark.parametrize(("bits", "head_bits"), [(4, 8), (8, 8), (4, 4)])
def test_weights_become_nbits_ops_with_the_head_and_embedding_sharing_bytes(bits: int, head_bits: int) -> None:
    proto, weights = _tied_decoder()
    ids = np.array([0, 5, V - 1], dtype=np.int64)
    model = ir.from_proto(proto)
    config = QuantizationConfig(bits=bits, block_size=32, accuracy_level=0, head_bits=head_bits)
    graph_pass = QuantizeWeightsPass(config)
    assert graph_pass(model).modified
    assert graph_pass.counts == {"matmul": 2, "lm_head": 1, "gather_shared": 1, "gather": 0, "left_float": 0, "offsets": 0, "kept": 0}
    ops = [(node.op_type, node.attributes.get_int("bits", 0)) for node in model.graph]
    assert ops == [
        ("GatherBlockQuantized", head_bits),
        ("MatMulNBits", bits),
        ("MatMulNBits", bits),
        ("MatMulNBits", head_bits),
    ]
    gather, *_, head = list(model.graph)
    # the embedding reads the head's bytes (as a flat table) and the head's very scales
    assert gather.inputs[2] is head.inputs[2]
    assert gather.inputs[0].const_value.tobytes() == head.inputs[1].const_value.tobytes()
    assert set(model.graph.initializers) == {
        v.name for node in model.graph for v in node.inputs if v is not None and v.const_value is not None
    }  # the float weights are gone

    # the same function computed with numpy's block-dequantized weights
    table = _block_dequantized(weights["E"].T, head_bits, 32).T  # [V, C]
    w1 = _block_dequantized(weights["W1"], bits, 32)
    w2 = _block_dequantized(weights["W2"], bits, 32)
    expected = table[ids] @ w1 @ w2 @ table.T
    np.testing.assert_allclose(_run(model, ids), expected, rtol=1e-4, atol=1e-4)
    # and it is an approximation of the float model, closer at 8 bits
    reference = _run(proto, ids)
    relative = np.abs(_run(model, ids) - reference).max() / np.abs(reference).max()
    assert relative < (0.02 if min(bits, head_bits) == 8 else 0.4)


def _channel_dequantized(weight_k_by_n: np.ndarray, bits: int) -> np.ndarray:
    """Symmetric weights of ``bits`` with one scale per column, in numpy: the reference."""
    top = 2 ** (bits - 1) - 1
    scale = np.abs(weight_k_by_n).max(axis=0) / top
    return np.clip(np.round(weight_k_by_n / scale), -top, top) * scale


def _row_quantized(x: np.ndarray) -> np.ndarray:
    """Each row to int8 steps of its own scale, max |x_row| / 127, in numpy: the activations' reference."""
    scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True) * np.float32(1 / 127), np.float32(1e-30))
    return np.clip(np.rint(x / scale), -128, 127) * scale


@pytest.mark.parametrize("channel_bits", [7, 8])
def test_per_channel_weights_become_row_quantized_products_with_the_tied_table_reading_the_head(channel_bits: int) -> None:
    proto, weights = _tied_decoder()
    ids = np.array([0, 5, V - 1], dtype=np.int64)
    model = ir.from_proto(proto)
    config = QuantizationConfig(bits=8, per_channel=True, channel_bits=channel_bits)
    graph_pass = QuantizeWeightsPass(config)
    assert graph_pass(model).modified
    assert graph_pass.counts == {"matmul": 2, "lm_head": 1, "gather_shared": 1, "gather": 0, "left_float": 0, "offsets": 0, "kept": 0}
    matmuls = [node for node in model.graph if node.op_type == "MatMulIntegerToFloat"]
    assert len(matmuls) == 3
    assert not [node for node in model.graph if node.op_type in ("MatMul", "Gemm", "MatMulNBits", "DynamicQuantizeMatMul")]
    for matmul in matmuls:  # uint8 activations around 128 (a scalar, as ORT's CPU kernel needs)
        assert matmul.inputs[0].producer().op_type == "QuantizeLinear"
        assert matmul.inputs[4].const_value.numpy().tolist() == 128
        # 7 bits: int8 weights, no zero point; 8 bits: uint8 weights around 128 (u8 x u8, exact)
        weight_zero = matmul.inputs[5]
        assert (weight_zero is None) if channel_bits == 7 else (weight_zero.const_value.numpy().tolist() == 128)
    head = matmuls[-1]
    gathers = [node for node in model.graph if node.op_type == "Gather"]
    # one copy of the bytes: the head's codes stored as the table's rows [V, C], which the
    # embedding gathers whole (axis 0) and the head reads through a Transpose
    columns = head.inputs[1].producer()
    assert columns.op_type == "Transpose" and list(columns.attributes.get_ints("perm")) == [1, 0]
    rows = columns.inputs[0]
    assert {node.inputs[0] for node in gathers} == {rows, head.inputs[3]}
    assert all(node.attributes.get_int("axis", 0) == 0 for node in gathers)
    assert rows.const_value.shape == (V, C)
    codes = rows.const_value.numpy().T
    assert codes.dtype == (np.int8 if channel_bits == 7 else np.uint8)
    assert np.abs(codes.astype(np.int32) - (0 if channel_bits == 7 else 128)).max() == 2 ** (channel_bits - 1) - 1
    assert set(model.graph.initializers) == {
        v.name for node in model.graph for v in node.inputs if v is not None and v.const_value is not None
    }  # the float weights are gone

    table = _channel_dequantized(weights["E"].T, channel_bits).T  # [V, C]
    w1, w2 = _channel_dequantized(weights["W1"], channel_bits), _channel_dequantized(weights["W2"], channel_bits)
    # numpy's product with each activation row quantized on its own: the same function
    expected = _row_quantized(_row_quantized(_row_quantized(table[ids]) @ w1) @ w2) @ table.T
    got = _run(model, ids)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
    reference = _run(proto, ids)
    assert np.abs(got - reference).max() < 0.05 * np.abs(reference).max()
    # each row is its own: alone, or batched beside any rows, it gives the very same floats
    for row, token in enumerate(ids):
        np.testing.assert_array_equal(_run(model, np.array([token])), got[row : row + 1])
    np.testing.assert_array_equal(_run(model, ids[::-1]), got[::-1])
    # the embedding alone is exact: ids straight to the dequantized rows
    embedded = ir.from_proto(proto)
    QuantizeWeightsPass(config)(embedded)
    embedded.graph.outputs[0] = next(n for n in embedded.graph if n.op_type == "Mul").outputs[0]
    np.testing.assert_allclose(_run(embedded, ids), table[ids], rtol=1e-6, atol=1e-6)


def _product(weight: np.ndarray, rows: int) -> tuple[ir.Model, str]:
    """``x @ weight`` as a one-MatMul model."""
    k, n = weight.shape
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["y"])],
        "product",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [rows, k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [rows, n])],
        [onnx.numpy_helper.from_array(weight, "W")],
    )
    return ir.from_proto(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)), "x"


VNNI = "avx512_vnni" in cpu_flags()


def _alternating_decoder() -> onnx.ModelProto:
    """The tied toy with every weight's signs alternating along its K axis."""
    proto, _ = _tied_decoder()
    for initializer in proto.graph.initializer:
        array = onnx.numpy_helper.to_array(initializer)
        flipped = _alternating(array.T).T if initializer.name == "E" else _alternating(array)  # E: the head's [V, C]
        initializer.CopyFrom(onnx.numpy_helper.from_array(flipped, initializer.name))
    return proto


def test_cpu_sessions_read_8_bit_channels_as_int8_where_asked(tmp_path, monkeypatch) -> None:
    """``open_session`` on CPU: KVEXPORT_INT8_KERNEL picks the kernel (auto: by the CPU's VNNI), the
    weights stay in the export's data file, and both kernels give the same floats on codes neither
    saturates; a value it does not know is one line."""
    model = ir.from_proto(_alternating_decoder())
    QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8))(model)
    path = tmp_path / "model.onnx"
    ir.save(model, path, external_data="model.onnx.data", size_threshold_bytes=1024)
    ids = np.array([0, 5, V - 1], dtype=np.int64)
    results = {}
    for kernel in ("u8u8", "u8s8"):
        monkeypatch.setenv("KVEXPORT_INT8_KERNEL", kernel)
        assert signed_int8_weights() is (kernel == "u8s8")
        results[kernel] = open_session(path, "cpu").run(None, {"ids": ids})[0]
    np.testing.assert_allclose(results["u8s8"], results["u8u8"], rtol=1e-6, atol=1e-6 * np.abs(results["u8u8"]).max())
    monkeypatch.setenv("KVEXPORT_INT8_KERNEL", "auto")
    assert signed_int8_weights() is (VNNI and platform.machine() == "x86_64")
    monkeypatch.setenv("KVEXPORT_INT8_KERNEL", "s8s8")
    with pytest.raises(ProviderError, match=r"^KVEXPORT_INT8_KERNEL=s8s8: choose auto, u8s8, u8u8$"):
        open_session(path, "cpu")


def test_each_row_is_quantized_by_one_blocked_quantize_linear_to_numpys_codes() -> None:
    """An opset-18 graph becomes opset 21 so that one ``QuantizeLinear`` (a block of ``K`` per
    row) divides each row by its scale: no ``Div``. Its codes are numpy's ``rint(x / scale) +
    128`` exactly, for rows of any size, one all zeros, and values on a half step (ties to even)."""
    rng = np.random.default_rng(3)
    k, n = 96, 40
    model, name = _product((rng.standard_normal((k, n)) / 8).astype(np.float32), 6)
    QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8))(model)
    assert model.opset_imports[""] == 21
    ops = [node.op_type for node in model.graph]
    assert "Div" not in ops and ops.count("QuantizeLinear") == 1
    quantize = next(node for node in model.graph if node.op_type == "QuantizeLinear")
    assert quantize.attributes.get_int("block_size") == k and quantize.attributes.get_int("axis") == -1
    model.graph.outputs.append(quantize.outputs[0])
    x = (rng.standard_normal((6, k)) * np.array([1e-3, 1, 30, 1, 1, 1])[:, None]).astype(np.float32)
    x[3] = 0.0
    x[4, :3] = [127.0, 0.5, 2.5]  # scale 1: half steps land on ties
    x[4, 3:] = 0.0
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    codes = session.run(None, {name: x})[1]
    scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True) * np.float32(1 / 127), np.float32(1e-30))
    np.testing.assert_array_equal(codes, (np.clip(np.rint(x / scale), -128, 127) + 128).astype(np.uint8))
    assert codes[4, :3].tolist() == [255, 128, 130]


@pytest.mark.parametrize(
    "signed",
    [False, pytest.param(True, marks=pytest.mark.skipif(not VNNI, reason="uint8 x int8 sums in int32 only on VNNI hosts"))],
)
def test_8_bit_channels_are_exact_with_full_range_codes(signed: bool) -> None:
    """Integer weights and activations in [-127, 127] whose rows and columns reach 127: every scale
    is 1, so the product must be numpy's integer product. Same-signed extremes are the case where a
    uint8 x int8 kernel's int16 pair sums (vpmaddubsw, x86 without VNNI) saturate; the 8-bit
    channels run uint8 x uint8, which does not. On AVX-512 VNNI hosts the runtime reads them as
    int8 (``signed``) for uint8 x int8, which sums in int32 there: exact too."""
    rng = np.random.default_rng(0)
    k, n = 256, 48
    weight = rng.integers(-127, 128, (k, n)).astype(np.float32)
    weight[0] = 127  # every column reaches 127
    weight[:, 0], weight[:, 1] = 127, -127  # whole columns at the extremes
    x = rng.integers(-127, 128, (4, k)).astype(np.float32)
    x[:, 0] = 127
    x[0], x[1] = 127, -127  # whole rows at the extremes, against them
    model, name = _product(weight, len(x))
    QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8))(model)
    assert [node.op_type for node in model.graph].count("MatMulIntegerToFloat") == 1
    if signed:
        assert SignedChannelsPass()(model).modified
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: x})[0]
    np.testing.assert_array_equal(got, (x.astype(np.int64) @ weight.astype(np.int64)).astype(np.float32))


def _alternating(weight: np.ndarray) -> np.ndarray:
    """``weight`` with its signs alternating along K (axis 0): any two neighbours' products with uint8
    activations then sum to at most 255 * 127, so even a uint8 x int8 kernel's int16 pair sums (x86
    without VNNI) hold them exactly."""
    signs = np.where(np.arange(weight.shape[0]) % 2 == 0, 1.0, -1.0).astype(np.float32)[:, None]
    return (np.abs(weight) * signs).astype(np.float32)


def _columns_layout(model: ir.Model) -> ir.Model:
    """``model`` (a tied per-channel export) as exports before December 2026 wrote it: the
    head reads its [C, V] codes directly, the table gathers their columns and transposes them."""
    old = ir.from_proto(ir.to_proto(model))
    graph = old.graph
    transpose = next(node for node in graph if node.op_type == "Transpose")
    rows = transpose.inputs[0]
    columns = ir.Value(name="E_q8u", const_value=ir.tensor(np.ascontiguousarray(rows.const_value.numpy().T)))
    columns.shape, columns.type = ir.Shape([C, V]), ir.TensorType(ir.DataType.UINT8)
    graph.register_initializer(columns)
    ir.convenience.replace_all_uses_with(transpose.outputs[0], columns)
    graph.remove(transpose, safe=True)
    gather = next(node for node in graph if node.op_type == "Gather" and node.inputs[0] is rows)
    gather.replace_input_with(0, columns)
    gather.attributes["axis"] = ir.AttrInt64("axis", 1)
    back = ir.node("Transpose", [gather.outputs[0]], attributes={"perm": [1, 0]})
    ir.convenience.replace_all_uses_with(gather.outputs[0], back.outputs[0])
    back.replace_input_with(0, gather.outputs[0])
    graph.insert_after(gather, [back])
    del graph.initializers[rows.name]
    return old


def test_signed_channels_read_the_same_codes_as_int8() -> None:
    """The runtime's rewrite for VNNI hosts: uint8 codes around 128 become int8 codes for uint8 x int8,
    with the tied table's gather reading them too; on codes that no kernel saturates, the same floats."""
    proto = _alternating_decoder()
    ids = np.array([0, 5, 9, V - 1], dtype=np.int64)
    unsigned = ir.from_proto(proto)
    QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8))(unsigned)
    signed = ir.from_proto(ir.to_proto(unsigned))
    graph_pass = SignedChannelsPass()
    assert graph_pass(signed).modified
    assert graph_pass.counts == {"weights": 3}  # W1, W2 and the tied head
    products = [node for node in signed.graph if node.op_type == "MatMulIntegerToFloat"]
    assert len(products) == 3
    for node in products:  # int8 codes folded from the uint8 bytes, no weight zero point
        assert len(node.inputs) < 6 or node.inputs[5] is None
        codes = node.inputs[1].producer()
        if codes.op_type == "Transpose":  # the tied head reads the table's rows transposed
            codes = codes.inputs[0].producer()
        assert (codes.op_type, codes.attributes.get_int("to")) == ("Cast", ir.DataType.INT8)
    head = products[-1]
    gather = next(node for node in signed.graph if node.op_type == "Gather" and node.inputs[0].const_value is None)
    assert gather.inputs[0] is head.inputs[1].producer().inputs[0]  # the table still reads the head's codes
    assert not [node for node in signed.graph if node.op_type == "Sub" and node.inputs[0].producer().op_type == "Cast"
                and node.inputs[0].producer().attributes.get_int("to") == ir.DataType.FLOAT]  # and lost its - 128
    expected = _run(unsigned, ids)
    np.testing.assert_allclose(_run(signed, ids), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    assert not SignedChannelsPass()(signed).modified  # nothing left to rewrite
    # an export from before the table's rows: the head's [C, V] columns, Gather(axis=1) -> Transpose
    columns = _columns_layout(unsigned)
    older = SignedChannelsPass()
    assert older(columns).modified and older.counts == {"weights": 3}
    assert not [node for node in columns.graph if node.op_type == "Sub"]
    np.testing.assert_allclose(_run(columns, ids), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    seven = ir.from_proto(proto)  # 7-bit int8 weights are not the pass's
    QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=7))(seven)
    assert not SignedChannelsPass()(seven).modified


def test_gated_blocks_keep_a_gated_units_product_in_blocks() -> None:
    """``(silu(x @ G) * (x @ U)) @ D``: with ``gated_blocks`` D (its input a Mul of two computed
    tensors) becomes MatMulNBits, G and U stay per channel; without it, all three are per channel."""
    rng = np.random.default_rng(1)
    weights = {name: (rng.standard_normal(shape) / 8).astype(np.float32) for name, shape in (("G", (C, HIDDEN)), ("U", (C, HIDDEN)), ("D", (HIDDEN, C)))}
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("MatMul", ["x", "G"], ["gate"]),
            onnx.helper.make_node("Sigmoid", ["gate"], ["sigmoid"]),
            onnx.helper.make_node("Mul", ["gate", "sigmoid"], ["silu"]),
            onnx.helper.make_node("MatMul", ["x", "U"], ["up"]),
            onnx.helper.make_node("Mul", ["silu", "up"], ["gated"]),
            onnx.helper.make_node("MatMul", ["gated", "D"], ["y"]),
        ],
        "mlp",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, C])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, C])],
        [onnx.numpy_helper.from_array(a, n) for n, a in weights.items()],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    x = rng.standard_normal((3, C)).astype(np.float32)
    reference = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for gated, kinds in ((True, ["MatMulIntegerToFloat", "MatMulIntegerToFloat", "MatMulNBits"]), (False, ["MatMulIntegerToFloat"] * 3)):
        model = ir.from_proto(proto)
        QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8, gated_blocks=gated))(model)
        assert [node.op_type for node in model.graph if node.op_type.startswith("MatMul")] == kinds
        down = [node for node in model.graph if node.op_type.startswith("MatMul")][-1]
        assert down.inputs[0].producer().op_type == ("Mul" if gated else "QuantizeLinear")
        session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, {"x": x})[0]
        assert np.abs(got - reference).max() < 0.02 * np.abs(reference).max()


def _gated_product(k: int, seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``(a * b) @ D`` (D [k, C]) and inputs whose gated product has a few outliers a row, at places that move from row to row."""
    rng = np.random.default_rng(seed)
    down = (rng.standard_normal((k, C)) / 8).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Mul", ["a", "b"], ["gated"]), onnx.helper.make_node("MatMul", ["gated", "D"], ["y"])],
        "down",
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["batch", "sequence", k]) for name in ("a", "b")],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", "sequence", C])],
        [onnx.numpy_helper.from_array(down, "D")],
    )
    a = rng.standard_normal((2, 8, k)).astype(np.float32)
    for row in a.reshape(-1, k):
        row[rng.choice(k, 2, replace=False)] *= 60.0
    feeds = {"a": a, "b": np.abs(rng.standard_normal((2, 8, k))).astype(np.float32)}
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10), feeds


def test_a_gated_rotation_lets_one_scale_per_row_hold_the_outliers() -> None:
    """``gated_rotation``: the gated product is rotated by float Hadamard blocks, then quantized per row.

    The rotation is exact in float (the weight is rotated by the same blocks), so the product's
    error is the row quantization's: with two 60x outliers a row, rotating first must cut the
    error of one scale per row by more than half, and stay within the blocks' error.
    """
    proto, feeds = _gated_product(HIDDEN, 2)
    reference = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    errors = {}
    for label, knobs in (("rows", {}), ("blocks", {"gated_blocks": True}), ("rotated", {"gated_rotation": 32})):
        model = ir.from_proto(proto)
        quantize = QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8, **knobs))
        quantize(model)
        products = [node for node in model.graph if node.op_type.startswith("MatMul")]
        if label == "rotated":
            rotate, down = products
            assert (rotate.op_type, down.op_type) == ("MatMul", "MatMulIntegerToFloat")
            hadamard = rotate.inputs[1].const_value.numpy()  # fp32, orthonormal, symmetric
            assert rotate.inputs[1].name == "kvexport.hadamard_32" and hadamard.dtype == np.float32
            np.testing.assert_allclose(hadamard @ hadamard, np.eye(32), atol=1e-6)
            assert rotate.inputs[0].producer().op_type == "Reshape"  # blocks of 32 values
            assert rotate.inputs[0].producer().inputs[0].producer().op_type == "Mul"  # the gated product
            assert quantize.counts["matmul"] + quantize.counts["lm_head"] == 1  # y is the graph output: "the head"
            assert not QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8))(model).modified
        session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, feeds)[0]
        assert got.shape == reference.shape
        errors[label] = float(np.abs(got - reference).mean() / np.abs(reference).mean())
    assert errors["rotated"] < 0.5 * errors["rows"], errors
    assert errors["rotated"] < errors["blocks"] * 1.5, errors


def test_a_gated_rotation_keeps_the_blocks_where_no_block_divides_k() -> None:
    proto, feeds = _gated_product(24, 3)  # 24: no power of two of 16 or more divides it
    model = ir.from_proto(proto)
    QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8, gated_rotation=64))(model)
    assert [node.op_type for node in model.graph] == ["Mul", "MatMulNBits"]
    reference = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.abs(got - reference).max() < 0.05 * np.abs(reference).max()


@pytest.mark.parametrize("rotation", [0, 32])
def test_a_gemms_bias_is_added_after_the_row_scale(rotation: int) -> None:
    """``Gemm(a * b, W, bias, transB=1)``, per channel with and without the gated rotation: the bias is
    added once, after the row scale (inside ``MatMulIntegerToFloat`` it would be multiplied by it)."""
    rng = np.random.default_rng(4)
    weight = (rng.standard_normal((C, HIDDEN)) / 8).astype(np.float32)  # [N, K], transB
    bias = np.full(C, 5.0, np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Mul", ["a", "b"], ["gated"]), onnx.helper.make_node("Gemm", ["gated", "W", "bias"], ["y"], transB=1)],
        "gemm",
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [5, HIDDEN]) for name in ("a", "b")],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [5, C])],
        [onnx.numpy_helper.from_array(weight, "W"), onnx.numpy_helper.from_array(bias, "bias")],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    feeds = {name: rng.standard_normal((5, HIDDEN)).astype(np.float32) for name in ("a", "b")}
    model = ir.from_proto(proto)
    QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True, channel_bits=8, gated_rotation=rotation))(model)
    assert [node.op_type for node in model.graph if node.op_type.startswith("MatMul")] == ["MatMul"] * bool(rotation) + ["MatMulIntegerToFloat"]
    reference = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    product = reference - bias
    assert np.abs(got - reference).max() < 0.03 * np.abs(product).max()


def test_per_channel_keeps_blocks_for_fp16_weights() -> None:
    proto, _ = _tied_decoder()
    half = ir.from_proto(proto)
    for value in half.graph.initializers.values():
        value.const_value = ir.tensor(value.const_value.numpy().astype(np.float16), name=value.name)
    QuantizeWeightsPass(QuantizationConfig(bits=8, per_channel=True))(half)
    assert [node.op_type for node in half.graph] == ["GatherBlockQuantized", "MatMulNBits", "MatMulNBits", "MatMulNBits"]


def test_asymmetric_blocks_carry_zero_points_and_stay_close() -> None:
    proto, _ = _tied_decoder()
    ids = np.arange(V, dtype=np.int64)
    model = ir.from_proto(proto)
    QuantizeWeightsPass(QuantizationConfig(bits=8, symmetric=False, accuracy_level=0))(model)
    assert all(len(node.inputs) == 4 for node in model.graph)  # a zero-point input each
    expected = _run(proto, ids)
    assert np.abs(_run(model, ids) - expected).max() < 0.05 * np.abs(expected).max()


def _on_q4_1_grid(k: int, n: int, seed: int) -> np.ndarray:
    """[K, N] weights that are exactly Q4_1 blocks along K: ``q * d + m``, q in 0..15, a float d and m each block of 32."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # every block spans its whole range, as Q4_1's quantizer leaves it
    step = rng.uniform(0.005, 0.05, size=(n, k // 32, 1)).astype(np.float32)
    low = rng.uniform(-0.4, 0.1, size=(n, k // 32, 1)).astype(np.float32)
    return (codes * step + low).astype(np.float32).reshape(n, k).T.copy()


@pytest.mark.parametrize(
    ("bits", "k", "accuracy_level"),
    # k 64: three zero points a row, the last alone in its byte; level 4 (int8 activations) where the
    # weights' error still dominates the activations' (at 8 bits it does not)
    [(4, 96, 1), (8, 96, 1), (4, 64, 4), (8, 64, 1)],
)
def test_block_offsets_keep_q4_1_weights_with_one_block_sum_per_activation(bits: int, k: int, accuracy_level: int) -> None:
    """``offsets``: integer zero points plus each block's remainder, rows of the product that the block sums multiply."""
    n = 40
    weights = {"Wq": _on_q4_1_grid(k, n, 1), "Wk": _on_q4_1_grid(k, n, 2)}
    graph = onnx.helper.make_graph(
        [  # a product that reaches an output through shape-only ops is an LM head (kept symmetric): a Mul each
            onnx.helper.make_node("MatMul", ["x", "Wq"], ["q_product"]),
            onnx.helper.make_node("MatMul", ["x", "Wk"], ["k_product"]),
            onnx.helper.make_node("Mul", ["q_product", "one"], ["q"]),
            onnx.helper.make_node("Mul", ["k_product", "one"], ["k"]),
        ],
        "shared",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", k])],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["rows", n]) for name in ("q", "k")],
        [onnx.numpy_helper.from_array(a, name) for name, a in {**weights, "one": np.ones(1, np.float32)}.items()],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    x = np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)

    def run(model: onnx.ModelProto) -> list[np.ndarray]:
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    offsets = ir.from_proto(proto)
    quantize = QuantizeWeightsPass(
        QuantizationConfig(bits=bits, block_size=32, symmetric=False, offsets=True, accuracy_level=accuracy_level)
    )
    quantize(offsets)
    assert quantize.counts["matmul"] == 2 and quantize.counts["offsets"] == 2
    ops = [node.op_type for node in offsets.graph]
    # Concat(X, X @ S) once, for both products; nothing more per product
    assert ops.count("MatMulNBits") == 2 and ops.count("MatMul") == 1 and ops.count("Concat") == 1 and len(ops) == 6
    assert all(node.attributes["K"].value == k + k // 32 for node in offsets.graph if node.op_type == "MatMulNBits")
    plain = ir.from_proto(proto)  # integer zero points alone: every block moved by up to half a step
    QuantizeWeightsPass(QuantizationConfig(bits=bits, block_size=32, symmetric=False, accuracy_level=accuracy_level))(plain)
    expected = [x.astype(np.float64) @ w.astype(np.float64) for w in weights.values()]
    for got, without, want in zip(run(ir.to_proto(offsets)), run(ir.to_proto(plain)), expected, strict=True):
        # the remainders' own rounding is left: a small fraction of the integer zero points' error
        error, plain_error = np.abs(got - want).mean(), np.abs(without - want).mean()
        assert error < plain_error / 3, (error, plain_error)
    manifest_knobs = QuantizationConfig(bits=bits, symmetric=False, offsets=True).to_json()
    assert manifest_knobs["offsets"] is True and "channel_bits" not in manifest_knobs


def test_rows_not_a_multiple_of_the_block_get_a_smaller_block() -> None:
    proto, weights = _tied_decoder()
    ids = np.array([1, 2], dtype=np.int64)
    model = ir.from_proto(proto)
    graph_pass = QuantizeWeightsPass(QuantizationConfig(bits=8, block_size=128, accuracy_level=0))
    graph_pass(model)
    # C = 64 rows: blocks of 64; the hidden 128: the asked 128
    blocks = [(node.op_type, node.attributes.get_int("block_size")) for node in model.graph]
    assert blocks == [
        ("GatherBlockQuantized", 64),
        ("MatMulNBits", 64),
        ("MatMulNBits", 128),
        ("MatMulNBits", 64),
    ]
    assert graph_pass.counts["left_float"] == 0
    table = _block_dequantized(weights["E"].T, 8, 64).T
    expected = table[ids] @ _block_dequantized(weights["W1"], 8, 64) @ _block_dequantized(weights["W2"], 8, 128) @ table.T
    np.testing.assert_allclose(_run(model, ids), expected, rtol=1e-4, atol=1e-4)


def test_rows_no_block_divides_stay_float() -> None:
    rng = np.random.default_rng(1)
    table = rng.standard_normal((11, 40)).astype(np.float32)  # 40: no block of 16+ divides it
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["E", "ids"], ["x"]), onnx.helper.make_node("Gemm", ["x", "E"], ["y"], transB=1)],
        "g",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["n"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 11])],
        [onnx.numpy_helper.from_array(table, "E")],
    )
    model = ir.from_proto(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10))
    graph_pass = QuantizeWeightsPass(QuantizationConfig(bits=8, block_size=32, accuracy_level=0))
    graph_pass(model)
    # the head pads its last block (MatMulNBits allows that); the table stays a float Gather
    assert [node.op_type for node in model.graph] == ["Gather", "MatMulNBits"]
    assert graph_pass.counts == {"matmul": 0, "lm_head": 1, "gather_shared": 0, "gather": 0, "left_float": 1, "offsets": 0, "kept": 0}
    ids = np.array([0, 10], dtype=np.int64)
    assert np.abs(_run(model, ids) - table[ids] @ table.T).max() < 0.05 * np.abs(table[ids] @ table.T).max()


def test_graph_without_weights_is_left_alone() -> None:
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["A", "B"], ["Y"])],
        "g",
        [
            onnx.helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [2, 32]),
            onnx.helper.make_tensor_value_info("B", onnx.TensorProto.FLOAT, [32, 4]),
        ],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [2, 4])],
    )
    model = ir.from_proto(onnx.helper.make_model(graph))
    graph_pass = QuantizeWeightsPass()
    assert not graph_pass(model).modified
    assert graph_pass.counts == {"matmul": 0, "lm_head": 0, "gather_shared": 0, "gather": 0, "left_float": 0, "offsets": 0, "kept": 0}
    assert [node.op_type for node in model.graph] == ["MatMul"]


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"bits": 3}, "bits 3: choose 4 or 8"),
        ({"block_size": 48}, "block size 48: use a power of two, at least 16"),
        ({"accuracy_level": 7}, "accuracy level 7: choose 0-4"),
        ({"bits": 4, "per_channel": True}, "per-channel weights are symmetric 8-bit"),
        ({"bits": 8, "head_bits": 4, "per_channel": True}, "per-channel weights are symmetric 8-bit"),
        ({"bits": 8, "gated_blocks": True}, "gated blocks go with per-channel weights"),
        ({"bits": 8, "per_channel": True, "channel_bits": 6}, "channel bits 6: choose 7 or 8"),
        ({"bits": 8, "per_channel": True, "gated_rotation": 48}, "gated rotation 48: use a power of two, at least 16"),
        ({"bits": 8, "gated_rotation": 64}, "a gated rotation goes with per-channel weights"),
        ({"bits": 8, "per_channel": True, "gated_blocks": True, "gated_rotation": 64}, "choose one"),
        ({"bits": 4, "offsets": True}, "block offsets go with asymmetric blocks"),
    ],
)
def test_bad_knobs_are_refused(knobs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantizationConfig(**knobs)


def test_a_table_that_a_product_packs_with_offsets_is_packed_again_for_its_gather() -> None:
    """A table read by a Gather and by a product that is not the head: the Gather gets symmetric whole rows, not the offset rows."""
    rng = np.random.default_rng(5)
    table = rng.standard_normal((V, C)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Gather", ["E", "ids"], ["embedded"]),
            onnx.helper.make_node("Gemm", ["embedded", "E"], ["scores"], transB=1),
            onnx.helper.make_node("Mul", ["scores", "two"], ["doubled"]),  # not shape-only: no LM head
            onnx.helper.make_node("Relu", ["doubled"], ["out"]),
        ],
        "table_twice",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["n"])],
        [
            onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["n", V]),
            onnx.helper.make_tensor_value_info("embedded", onnx.TensorProto.FLOAT, ["n", C]),
        ],
        [onnx.numpy_helper.from_array(table, "E"), onnx.numpy_helper.from_array(np.full(1, 2, np.float32), "two")],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    model = ir.from_proto(proto)
    config = QuantizationConfig(bits=8, block_size=32, symmetric=False, offsets=True, accuracy_level=1, head_bits=8)
    quantize = QuantizeWeightsPass(config)
    quantize(model)
    assert quantize.counts["matmul"] == 1 and quantize.counts["offsets"] == 1 and quantize.counts["gather"] == 1
    gather = next(node for node in model.graph if node.op_type == "GatherBlockQuantized")
    assert gather.inputs[0].const_value.numpy().shape == (V, C)  # type: ignore[union-attr]  # rows of C codes, no offset rows
    ids = np.array([0, 3, 66], np.int64)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    _, embedded = session.run(None, {"ids": ids})
    step = np.abs(table[ids]).max(-1, keepdims=True) / 127
    assert np.abs(embedded - table[ids]).max() <= step.max()
