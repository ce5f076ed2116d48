"""PromptProductsPass and kvexport's bf16 prompt product (``kvexport.PromptMatMul``).

The kernel is checked on each path (AMX tiles, AVX512-BF16 dot products, the portable loop)
against numpy's float64 product of the same bf16-rounded operands, at shapes its tiles take
whole and at ragged ones (rows, K and N not multiples of the tiles), with and without a bias;
a path this CPU lacks is skipped by name, the portable one always runs. The pass is checked
on graphs the weight quantizer wrote (int8 blocks, int4 blocks with offsets): each product but
the head's replaced, its weight ``MatMulNBits``' own (the dequantization against ONNX Runtime's
fp32 reading of the blocks), the outputs within bf16's rounding of the blocks'. The runner's
prompt session is checked on the trained int8 export against its decoding session.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvexport.errors import ManifestError
from kvexport.passes import PromptProductsPass, QuantizationConfig, QuantizeWeightsPass, vocabulary
from kvexport.passes.prompt_products import bf16_bits, dequantize_nbits, pack_bf16, pack_gated
from kvexport.runtime import kernels
from kvexport.runtime.opened import open_export
from kvexport.serving.runner import ModelRunner

PATHS = ("amx", "avx512bf16", "generic")


@pytest.fixture(scope="module")
def library() -> Path:
    """The built kernel library (built here where the set-up did not)."""
    return kernels.library_path() or kernels.build()


def _bf16(values: np.ndarray) -> np.ndarray:
    return (bf16_bits(values).astype(np.uint32) << 16).view(np.float32)


def _session(model: bytes, library: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _kernel_graph(weight: np.ndarray, bias: np.ndarray | None) -> bytes:
    k, n = weight.shape
    packed = pack_bf16(weight)
    initializers = [helper.make_tensor("w", TensorProto.BFLOAT16, packed.shape, packed.tobytes(), raw=True)]
    if bias is not None:
        initializers.append(numpy_helper.from_array(bias, "bias"))
    node = helper.make_node(
        vocabulary.PROMPT_MATMUL, ["a", "w"] + (["bias"] if bias is not None else []), ["y"], domain=vocabulary.KVEXPORT_DOMAIN, K=k, N=n
    )
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["b", "s", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])], initializers,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(vocabulary.KVEXPORT_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def _use_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.PROMPT_GEMM_VARIABLE, path)
    if kernels.prompt_gemm_path() != path:
        pytest.skip(f"this CPU has no {path} path (AMX tiles and AVX512-BF16 are checked where the host has them)")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("rows", "k", "n", "with_bias"), [(64, 96, 48, False), (77, 100, 37, True), (1, 64, 16, True), (130, 160, 80, False)])
def test_the_kernel_gives_the_bf16_product(library: Path, monkeypatch: pytest.MonkeyPatch, path: str, rows: int, k: int, n: int, with_bias: bool) -> None:
    _use_path(path, monkeypatch)
    rng = np.random.default_rng(rows + k)
    weight = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    a = rng.standard_normal((1, rows, k)).astype(np.float32)
    got = _session(_kernel_graph(weight, bias), library).run(None, {"a": a})[0]
    expected = _bf16(a).astype(np.float64) @ _bf16(weight).astype(np.float64) + (0 if bias is None else bias)
    assert got.shape == (1, rows, n)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4 * np.abs(expected).max())


def _fused_graph(k: int, packed: np.ndarray, widths: list[int], attributes: dict[str, object]) -> bytes:
    initializers = [helper.make_tensor("w", TensorProto.BFLOAT16, packed.shape, packed.tobytes(), raw=True)]
    outputs = [f"y{i}" for i in range(len(widths))]
    node = helper.make_node(vocabulary.PROMPT_MATMUL, ["a", "w"], outputs, domain=vocabulary.KVEXPORT_DOMAIN, K=k, **attributes)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["s", k])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["s", n]) for name, n in zip(outputs, widths, strict=True)], initializers,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(vocabulary.KVEXPORT_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("rows", "k", "n"), [(64, 96, 64), (77, 100, 40), (1, 64, 16), (130, 160, 200)])
def test_the_gated_kernel_gives_silu_of_the_gate_times_up(library: Path, monkeypatch: pytest.MonkeyPatch, path: str, rows: int, k: int, n: int) -> None:
    _use_path(path, monkeypatch)
    rng = np.random.default_rng(rows + n)
    gate, up = (rng.standard_normal((k, n)).astype(np.float32) * 0.3 for _ in range(2))
    a = rng.standard_normal((rows, k)).astype(np.float32)
    got = _session(_fused_graph(k, pack_gated(gate, up), [n], {"N": n, "gated": 1}), library).run(None, {"a": a})[0]
    rows64 = _bf16(a).astype(np.float64)
    g, u = rows64 @ _bf16(gate).astype(np.float64), rows64 @ _bf16(up).astype(np.float64)
    expected = g / (1 + np.exp(-g)) * u
    assert got.shape == (rows, n)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("rows", "widths"), [(64, [576 // 9, 32, 32]), (45, [48, 16, 20]), (1, [16, 7])])
def test_the_split_kernel_gives_each_product_its_own_output(
    library: Path, monkeypatch: pytest.MonkeyPatch, path: str, rows: int, widths: list[int]
) -> None:
    _use_path(path, monkeypatch)
    rng = np.random.default_rng(rows)
    k = 96
    weights = [rng.standard_normal((k, n)).astype(np.float32) for n in widths]
    a = rng.standard_normal((rows, k)).astype(np.float32)
    attributes = {"N": sum(widths), "splits": widths}
    got = _session(_fused_graph(k, pack_bf16(np.concatenate(weights, axis=1)), widths, attributes), library).run(None, {"a": a})
    for output, weight in zip(got, weights, strict=True):
        expected = _bf16(a).astype(np.float64) @ _bf16(weight).astype(np.float64)
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-4 * np.abs(expected).max())


def test_splits_that_do_not_fit_the_kernel_are_refused(library: Path) -> None:
    with pytest.raises(Exception, match="splits must be positive, each but the last a multiple of 16"):
        _session(_fused_graph(32, pack_bf16(np.ones((32, 40), np.float32)), [20, 20], {"N": 40, "splits": [20, 20]}), library)
    with pytest.raises(Exception, match="splits must sum to N"):
        _session(_fused_graph(32, pack_bf16(np.ones((32, 48), np.float32)), [16, 16], {"N": 48, "splits": [16, 16]}), library)


def test_an_unknown_or_missing_path_is_refused_in_one_line(library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.PROMPT_GEMM_VARIABLE, "tiles")
    assert kernels.prompt_gemm_path() == "unavailable"
    with pytest.raises(Exception, match="KVEXPORT_PROMPT_GEMM=tiles is not amx, avx512bf16, generic or auto"):
        _session(_kernel_graph(np.ones((32, 16), np.float32), None), library)


def _quantized_graph(config: QuantizationConfig, widths: tuple[int, ...], k: int = 64) -> tuple[ir.Model, list[np.ndarray]]:
    """``a`` through one MatMul per width, each then a Tanh (outputs ``y0``, ``y1``, ...: no product is a head), weights quantized with ``config``."""
    rng = np.random.default_rng(7)
    weights = [rng.standard_normal((k, n)).astype(np.float32) * 0.1 for n in widths]
    nodes = [helper.make_node("MatMul", ["a", f"w{i}"], [f"p{i}"]) for i in range(len(widths))]
    nodes += [helper.make_node("Tanh", [f"p{i}"], [f"y{i}"]) for i in range(len(widths))]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["s", k])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["s", n]) for i, n in enumerate(widths)],
        [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    QuantizeWeightsPass(config)(model)
    return model, weights


@pytest.mark.parametrize(
    "config",
    [
        QuantizationConfig(bits=8, block_size=32, symmetric=True, accuracy_level=4, head_bits=8),
        QuantizationConfig(bits=4, block_size=32, symmetric=False, offsets=True, accuracy_level=4, head_bits=8),
    ],
    ids=["int8-blocks", "int4-offsets"],
)
def test_the_pass_puts_the_kernel_in_each_products_place_but_the_heads(library: Path, config: QuantizationConfig) -> None:
    model, _ = _quantized_graph(config, (48, 80))
    before = ir.to_proto(model).SerializeToString()
    nbits = [node for node in model.graph if node.op_type == vocabulary.MATMUL_NBITS]
    assert len(nbits) == 2
    # the weights as MatMulNBits holds them, read back by ONNX Runtime itself (fp32 compute: accuracy level 0)
    reference = ir.from_proto(ir.to_proto(model))
    for node in reference.graph:
        if node.op_type == vocabulary.MATMUL_NBITS:
            node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", 0)
    a = np.random.default_rng(3).standard_normal((40, 64)).astype(np.float32)
    blocks = _session(ir.to_proto(reference).SerializeToString(), library).run(None, {"a": a})
    products = PromptProductsPass(skip_width=80)
    assert products(model).modified
    assert products.counts["nodes"] == 1
    ops = [node.op_type for node in model.graph]
    assert ops.count(vocabulary.PROMPT_MATMUL) == 1 and ops.count(vocabulary.MATMUL_NBITS) == 1  # the head's kept
    got = _session(ir.to_proto(model).SerializeToString(), library).run(None, {"a": a})
    np.testing.assert_array_equal(got[1], _session(before, library).run(None, {"a": a})[1])
    # bf16 rounds the activations and the blocks' values by at most 2**-9 each
    np.testing.assert_allclose(got[0], blocks[0], rtol=0, atol=2e-2 * np.abs(blocks[0]).max())
    assert np.abs(got[0] - blocks[0]).mean() < 3e-3 * np.abs(blocks[0]).mean()


def _layer_graph() -> ir.Model:
    """A layer's products as a Llama exports them, int8 blocks: q, k, v of the same rows, then down(silu(gate(x)) * up(x))."""
    rng = np.random.default_rng(11)
    k, widths = 64, {"q": 64, "k": 32, "v": 32, "gate": 96, "up": 96}
    weights = {name: rng.standard_normal((k, n)).astype(np.float32) * 0.1 for name, n in widths.items()}
    weights["down"] = rng.standard_normal((96, k)).astype(np.float32) * 0.1
    nodes = [helper.make_node("MatMul", ["a", f"w_{name}"], [name]) for name in ("q", "k", "v", "gate", "up")]
    nodes += [
        helper.make_node("Sigmoid", ["gate"], ["sig"]),
        helper.make_node("Mul", ["gate", "sig"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "w_down"], ["down"]),
        helper.make_node("Concat", ["q", "k", "v", "down"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["s", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["s", 64 + 32 + 32 + k])],
        [numpy_helper.from_array(w, f"w_{name}") for name, w in weights.items()],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    QuantizeWeightsPass(QuantizationConfig(bits=8, block_size=32, symmetric=True, accuracy_level=4, head_bits=8))(model)
    return model


def test_the_pass_fuses_products_of_the_same_rows_and_the_swiglu(library: Path) -> None:
    if kernels.prompt_gemm_path() not in kernels.FAST_PROMPT_GEMMS:
        pytest.skip("this CPU has neither AMX nor AVX512-BF16: the fused kernels are checked above on the portable path")
    a = np.random.default_rng(4).standard_normal((70, 64)).astype(np.float32)
    results = {}
    for fuse in (True, False):
        model = _layer_graph()
        products = PromptProductsPass(fuse=fuse)
        assert products(model).modified and products.counts["nodes"] == 6
        ops = [node.op_type for node in model.graph]
        if fuse:
            assert products.counts == {"nodes": 6, "kernels": 3, "gated": 1, "split": 1}
            assert "Sigmoid" not in ops and "Mul" not in ops
            kernels_written = [node for node in model.graph if node.op_type == vocabulary.PROMPT_MATMUL]
            assert [len(node.outputs) for node in kernels_written] == [3, 1, 1]
            assert list(kernels_written[0].attributes["splits"].value) == [64, 32, 32]
            assert kernels_written[1].attributes["gated"].value == 1 and kernels_written[1].attributes["N"].value == 96
        else:
            assert ops.count(vocabulary.PROMPT_MATMUL) == 6 and "Sigmoid" in ops
        results[fuse] = _session(ir.to_proto(model).SerializeToString(), library).run(None, {"a": a})[0]
    # the same bf16 products; only the activation's arithmetic differs (the kernel's exp against ONNX Runtime's Sigmoid)
    np.testing.assert_allclose(results[True], results[False], rtol=1e-4, atol=1e-5 * np.abs(results[False]).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_the_dequantized_weight_is_what_matmulnbits_computes_with(library: Path, bits: int) -> None:
    """Int8 blocks, and int4 blocks with their offsets' remainder rows (K + K/32 rows, 4-bit codes)."""
    symmetric = bits == 8
    config = QuantizationConfig(bits=bits, block_size=32, symmetric=symmetric, offsets=not symmetric, accuracy_level=4, head_bits=8)
    model, _ = _quantized_graph(config, (48,), k=128)
    assert next(node for node in model.graph if node.op_type == vocabulary.MATMUL_NBITS).attributes["bits"].value == bits
    node = next(node for node in model.graph if node.op_type == vocabulary.MATMUL_NBITS)
    constants = [value.const_value.numpy() if value is not None and value.const_value is not None else None for value in node.inputs[1:4]]
    codes, scales, zero = [*constants, None][:3]
    assert codes is not None and scales is not None
    k, n, bits = (node.attributes[name].value for name in ("K", "N", "bits"))
    weight = dequantize_nbits(codes, scales, zero, k, bits)
    # the node alone, its blocks read by ONNX Runtime in fp32 (accuracy level 0)
    names = ["a", "codes", "scales"] + (["zero"] if zero is not None else [])
    arrays = [codes, scales] + ([zero] if zero is not None else [])
    alone = helper.make_node(
        vocabulary.MATMUL_NBITS, names, ["y"], domain=vocabulary.MS_DOMAIN, K=k, N=n, bits=bits, block_size=32, accuracy_level=0
    )
    graph = helper.make_graph(
        [alone], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["s", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["s", n])],
        [numpy_helper.from_array(array, name) for array, name in zip(arrays, names[1:], strict=True)],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(vocabulary.MS_DOMAIN, 1)]
    a = np.random.default_rng(5).standard_normal((8, k)).astype(np.float32)
    got = _session(helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString(), library).run(None, {"a": a})[0]
    np.testing.assert_allclose(a @ weight, got, rtol=1e-4, atol=1e-4)


def test_the_runners_prompt_session_gives_the_blocks_logits_within_bf16(library: Path, trained_exports: dict[str, Path]) -> None:
    if kernels.prompt_gemm_path() not in kernels.FAST_PROMPT_GEMMS:
        pytest.skip("this CPU has neither AMX nor AVX512-BF16: the runner opens no prompt session here")
    opened = open_export(trained_exports["int8"], "cpu")
    runner = ModelRunner(opened, 2, 128, intra_op_threads=2, prompt_products=True)
    assert runner.prompt_session is not None and runner.prompt_products in kernels.FAST_PROMPT_GEMMS
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, opened.manifest.dims.vocab_size, 60)]
    prompt = runner.run_piece(0, tokens, 0)[-1]
    blocks = runner.cache.run_piece(runner.session, 1, tokens, 0)[-1]
    assert prompt.argmax() == blocks.argmax()
    np.testing.assert_allclose(prompt, blocks, atol=0.05 * np.abs(blocks).max())
    # the prompt's keys and values land in the shared cache: the decode call after it reads them
    decoded = runner.decode([int(prompt.argmax()), int(blocks.argmax())], [60, 60])
    np.testing.assert_allclose(decoded[0], decoded[1], atol=0.05 * np.abs(decoded[1]).max())


def test_without_bf16_units_or_asked_off_there_is_one_session(trained_exports: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    opened = open_export(trained_exports["int8"], "cpu")
    assert ModelRunner(opened, 1, 64, prompt_products=False).prompt_session is None
    monkeypatch.setenv(kernels.PROMPT_GEMM_VARIABLE, "generic")
    runner = ModelRunner(opened, 1, 64, prompt_products=True)
    assert runner.prompt_session is None and runner.prompt_products.startswith("no bf16 units for prompts here")
    with pytest.raises(ManifestError):  # a graph of kvexport's ops where the library is off is one line, not a crash
        monkeypatch.setenv(kernels.KERNELS_VARIABLE, "off")
        from kvexport.runtime.session import _register_kernels

        _register_kernels({(vocabulary.KVEXPORT_DOMAIN, vocabulary.PROMPT_MATMUL)}, Path("g.onnx"), None, ort.SessionOptions())
