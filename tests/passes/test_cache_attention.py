"""CacheAttentionPass and kvexport's attention kernel (``kvexport.CacheAttention``).

The kernel is checked against ONNX Runtime's own ``GroupQueryAttention`` over the same
inputs (outputs and the cache it leaves, in place and not): decode calls with rows of
different lengths, a prompt piece after a past, fresh prompts batched with a right-padded
row, a padding bias with holes, a local window, one and three query heads a KV head, head
sizes the AVX-512 tiles take and one they do not. The pass is checked on the graphs (the
kernel in each attention's place, the products left what the kernel can't take, quantized
caches and caches that grow kept on the op) and through the runner, against the same
export with the kernel switched off. The library is built if it is not (the suite's set-up
builds it: ``scripts/install.sh``), so the rest of the suite's parity tests against PyTorch
run through it too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kvexport import export_model
from kvexport.errors import KvexportError
from kvexport.passes import CacheAttentionPass, PromptAttentionPass, vocabulary
from kvexport.runtime import kernels
from kvexport.runtime.opened import open_export
from kvexport.runtime.session import cpu_graph, session_options
from kvexport.serving.runner import ModelRunner

TRAINED_LLAMA = Path(__file__).parents[1] / "data" / "tiny-trained-llama"


@pytest.fixture(scope="module")
def library() -> Path:
    """The built kernel library (built here where the set-up did not)."""
    return kernels.library_path() or kernels.build()


@pytest.fixture(scope="module")
def llama_ort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cache-attention-llama") / "out"
    export_model(out, str(TRAINED_LLAMA), target="ort-cpu")
    return out


def _attention_session(
    library: Path, kernel: bool, rows: int, tokens: int, heads: int, kv_heads: int, size: int, capacity: int, window: int
) -> ort.InferenceSession:
    """One attention node over a bound cache: kvexport's kernel or ONNX Runtime's op."""
    float_ = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("q", float_, [rows, tokens, heads * size]),
        helper.make_tensor_value_info("k", float_, [rows, tokens, kv_heads * size]),
        helper.make_tensor_value_info("v", float_, [rows, tokens, kv_heads * size]),
        helper.make_tensor_value_info("past_key", float_, [rows, kv_heads, capacity, size]),
        helper.make_tensor_value_info("past_value", float_, [rows, kv_heads, capacity, size]),
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, [rows]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
        helper.make_tensor_value_info("bias", float_, [rows, 1, tokens, "T"]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", float_, [rows, tokens, heads * size]),
        helper.make_tensor_value_info("present_key", float_, [rows, kv_heads, capacity, size]),
        helper.make_tensor_value_info("present_value", float_, [rows, kv_heads, capacity, size]),
    ]
    attributes = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": 0.0 if kernel else 1 / np.sqrt(size), "local_window_size": window}
    if kernel:  # scale 0: the kernel's own 1/sqrt(D)
        node = helper.make_node(
            "CacheAttention", ["q", "k", "v", "past_key", "past_value", "seqlens", "bias"], ["out", "present_key", "present_value"], domain="kvexport", **attributes
        )
    else:
        node = helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_key", "past_value", "seqlens", "total", "", "", "", "bias"],
            ["out", "present_key", "present_value"],
            domain="com.microsoft",
            **attributes,
        )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("kvexport", 1)]
    model = helper.make_model(helper.make_graph([node], "attention", inputs, outputs), opset_imports=opsets, ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


# (query heads, KV heads, head size, tokens a row, seqlens_k a row, local window, present bound to the past's buffer)
CASES = {
    "decode, three heads a group": (9, 3, 64, 1, [0, 1, 17, 40, 47], -1, True),
    "decode, one head a group": (4, 4, 64, 1, [0, 1, 17, 40, 47], -1, True),
    "decode, a local window": (6, 2, 64, 1, [0, 1, 17, 40, 47], 5, True),
    "decode, present not the past's buffer": (9, 3, 64, 1, [0, 1, 17, 40, 47], -1, False),
    "a piece after a past": (9, 3, 64, 37, [100], -1, True),
    "a piece after a past, a local window": (6, 2, 64, 21, [60], 9, True),
    "fresh prompts, one right padded": (9, 3, 64, 40, [39, 20, 39], -1, True),
    "fresh prompts, one right padded far past its window": (6, 2, 64, 64, [5, 63], 4, True),
    "a piece, head size 48 (no tiles)": (4, 2, 48, 19, [70], -1, False),
    "a piece, head size 128": (4, 1, 128, 33, [90], -1, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_gives_group_query_attentions_output_and_cache(library: Path, case: str) -> None:
    heads, kv_heads, size, tokens, seqlens, window, in_place = CASES[case]
    rows, capacity = len(seqlens), 128
    rng = np.random.default_rng(len(case))
    lengths = np.array(seqlens, np.int32)  # a row's last position; its tokens end there (a first prompt's may be padded)
    total = int(lengths.max()) + 1
    mask = np.ones((rows, total), bool)
    mask[0, 1:3] = False  # holes in a row (left padding, or a slot's gap), as the runner's mask has them
    mask[-1, : min(20, total - 1)] = False
    bias = np.where(mask, 0, np.finfo(np.float32).min).astype(np.float32)[:, None, None, :]
    feeds = {
        "q": rng.standard_normal((rows, tokens, heads * size)).astype(np.float32),
        "k": rng.standard_normal((rows, tokens, kv_heads * size)).astype(np.float32),
        "v": rng.standard_normal((rows, tokens, kv_heads * size)).astype(np.float32),
        "seqlens": lengths,
        "total": np.array(total, np.int32),
        "bias": np.ascontiguousarray(np.broadcast_to(bias, (rows, 1, tokens, total))),  # the op wants the tokens' axis whole
    }
    cache = {name: rng.standard_normal((rows, kv_heads, capacity, size)).astype(np.float32) for name in ("past_key", "past_value")}
    results = {}
    for kernel in (False, True):
        session = _attention_session(library, kernel, rows, tokens, heads, kv_heads, size, capacity, window)
        binding = session.io_binding()
        for name, array in feeds.items():  # total: the op's input; the kernel's graph has it unread
            binding.bind_cpu_input(name, array)
        binding.bind_output("out")
        buffers = {name: ort.OrtValue.ortvalue_from_numpy(array.copy()) for name, array in cache.items()}
        for name, buffer in buffers.items():
            binding.bind_ortvalue_input(name, buffer)
            if in_place:
                binding.bind_ortvalue_output(name.replace("past", "present"), buffer)
            else:
                binding.bind_output(name.replace("past", "present"))
        session.run_with_iobinding(binding)
        bound = ["out", "present_key", "present_value"]  # in the order they were bound
        results[kernel] = dict(zip(bound, binding.copy_outputs_to_cpu(), strict=True))
        if not in_place:  # the past is read, not written
            for name, buffer in buffers.items():
                np.testing.assert_array_equal(buffer.numpy(), cache[name])
    assert np.isfinite(results[True]["out"]).all()  # padding queries too: they see what the row's last sees
    for row, last in enumerate(lengths):
        past = max(0, int(last) + 1 - tokens)
        valid = int(last) + 1 - past  # a right-padded first prompt's queries past its last position are the op's own
        # and so are those that see no key the mask keeps (left padding's own queries: the op gives zeros there)
        seen = [s for s in range(valid) if mask[row, : past + s + 1].any()]
        assert len(seen) >= valid // 2
        np.testing.assert_allclose(results[True]["out"][row, seen], results[False]["out"][row, seen], rtol=1e-5, atol=2e-6)
        for name in ("present_key", "present_value"):  # every position up to the row's last: the past's, and the new rows
            np.testing.assert_array_equal(results[True][name][row, :, : last + 1], results[False][name][row, :, : last + 1])
        # the call's keys went where the op put them
        np.testing.assert_array_equal(
            results[True]["present_key"][row, :, past : past + valid], feeds["k"][row, :valid].reshape(valid, kv_heads, size).transpose(1, 0, 2)
        )


def test_the_pass_puts_the_kernel_in_each_attentions_place(llama_ort: Path, trained_exports: dict[str, Path]) -> None:
    prefill = ir.load(llama_ort / "prefill.onnx")
    layers = sum(n.op_type == "GroupQueryAttention" for n in prefill.graph)
    outputs = [value.name for value in prefill.graph.outputs]
    result = CacheAttentionPass()(prefill)
    assert result.modified and layers > 0
    kernels_ = [n for n in prefill.graph if n.op_type == vocabulary.CACHE_ATTENTION]
    assert len(kernels_) == layers and all(n.domain == vocabulary.KVEXPORT_DOMAIN for n in kernels_)
    assert not any(n.op_type in ("GroupQueryAttention", "If") for n in prefill.graph)
    for node in kernels_:
        assert node.attributes["num_heads"].value == 4 and node.attributes["kv_num_heads"].value == 2
        assert len(node.inputs) == 7 and node.inputs[6] is not None  # the padding bias, total_sequence_length left out
    assert [value.name for value in prefill.graph.outputs] == outputs  # the presents keep their names and places
    assert prefill.opset_imports[vocabulary.KVEXPORT_DOMAIN] == 1
    assert not CacheAttentionPass()(prefill).modified and not PromptAttentionPass()(prefill).modified  # nothing left

    decode = ir.load(llama_ort / "decode.onnx")  # one token a row
    assert CacheAttentionPass()(decode).modified
    assert sum(n.op_type == vocabulary.CACHE_ATTENTION for n in decode.graph) == layers

    for quantized in ("kv-int8", "kv-int4"):  # quantized caches: the op (and the products, for an 8-bit one's prompts)
        model = ir.load(trained_exports[quantized] / "prefill.onnx")
        assert not CacheAttentionPass()(model).modified
    gpt2 = ir.load(trained_exports["int8-pc"] / "prefill.onnx")  # GPT-2: one KV head a query head
    assert CacheAttentionPass()(gpt2).modified and not any(n.op_type == "GroupQueryAttention" for n in gpt2.graph)


def test_a_cache_that_grows_keeps_the_op(llama_ort: Path) -> None:
    """A present longer than its past (a concat cache: the call's rows appended) is not the kernel's in-place buffer."""
    model = ir.load(llama_ort / "decode.onnx")
    for value in model.graph.outputs:
        if value.name.startswith("present.") and value.shape is not None:
            dims = list(value.shape)
            value.shape = ir.Shape([*dims[:2], f"{dims[2]}_plus_1", dims[3]])
    assert any(n.op_type == "GroupQueryAttention" for n in model.graph)
    assert not CacheAttentionPass()(model).modified


def test_a_window_of_no_positions_keeps_the_op(llama_ort: Path) -> None:
    """``local_window_size`` 0 is the op's (a window of no positions); the kernel reads 0 as none, so it is not taken."""
    model = ir.load(llama_ort / "decode.onnx")
    for node in model.graph:
        if node.op_type == "GroupQueryAttention":
            node.attributes["local_window_size"] = ir.AttrInt64("local_window_size", 0)
    assert not CacheAttentionPass()(model).modified
    for node in model.graph:  # a window of a position or more is taken
        if node.op_type == "GroupQueryAttention":
            node.attributes["local_window_size"] = ir.AttrInt64("local_window_size", 1)
    assert CacheAttentionPass()(model).modified


def _calls(export: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Logits of batched prompts, a piece after a past, decode steps, and the cache they leave, with the kernels ``mode``."""
    monkeypatch.setenv(kernels.KERNELS_VARIABLE, mode)
    runner = ModelRunner(open_export(export), 4, 64)
    rng = np.random.default_rng(5)
    vocab = runner.vocab_size
    logits = [runner.run_rows(0, [list(rng.integers(0, vocab, 13)) for _ in range(3)])]
    logits.append(runner.decode([1, 2, 3], [13, 13, 13]))
    logits.append(runner.run_rows(3, [list(rng.integers(0, vocab, 9))]))
    logits.append(runner.run_piece(3, list(rng.integers(0, vocab, 7)), 9))
    for step in range(3):  # rows of different lengths
        logits.append(runner.decode([4 + step, 5, 6, 7], [14 + step, 14 + step, 14 + step, 16 + step]))
    cache = [runner.cache.banks.host_view(0, i, (4, *runner.cache.row_shape)).copy() for i in range(len(runner.cache.past))]
    return [np.array(x, np.float32) for x in logits], cache


def test_calls_through_the_kernel_give_the_ops_logits_and_cache(library: Path, llama_ort: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.KERNELS_VARIABLE, str(library))
    graph = cpu_graph(llama_ort / "prefill.onnx", session_options())  # what the runner's session loads
    assert isinstance(graph, bytes) and vocabulary.CACHE_ATTENTION.encode() in graph
    expected_logits, expected_cache = _calls(llama_ort, monkeypatch, "off")
    logits, cache = _calls(llama_ort, monkeypatch, str(library))
    for got, want in zip(logits, expected_logits, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    for got, want in zip(cache, expected_cache, strict=True):
        for row, n in enumerate([17, 17, 17, 19]):
            np.testing.assert_allclose(got[row, :, :n], want[row, :, :n], rtol=1e-4, atol=2e-5)


def test_the_kernels_build_from_the_headers_kvexport_carries(tmp_path: Path) -> None:
    """No download and no system package: the carried headers compile a library ONNX Runtime registers."""
    assert sorted(p.name for p in kernels.BUNDLED_HEADERS.glob("*.h")) == [
        "onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h", "onnxruntime_float16.h"
    ]
    library = kernels.build(output=tmp_path / "lib.so")
    session = _attention_session(library, True, 1, 1, 2, 1, 64, 8, -1)  # the op resolves from the library
    assert [o.name for o in session.get_outputs()] == ["out", "present_key", "present_value"]


def test_build_and_the_variable_refuse_what_is_missing_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = [sys.executable, "-m", "kvexport.cli"]
    done = subprocess.run([*cli, "build-kernels", "--ort-include", str(tmp_path)], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"Error: --ort-include {tmp_path}: no onnxruntime_cxx_api.h there"]
    assert not list(tmp_path.iterdir())
    missing = tmp_path / "nothing.so"
    monkeypatch.setenv(kernels.KERNELS_VARIABLE, str(missing))
    with pytest.raises(KvexportError, match=f"KVEXPORT_KERNELS={missing}: no such library"):
        kernels.library_path()
    monkeypatch.setenv(kernels.KERNELS_VARIABLE, "off")
    assert kernels.library_path() is None


def test_the_kernel_refuses_tokens_outside_the_cache(library: Path) -> None:
    session = _attention_session(library, True, 1, 1, 4, 2, 64, 8, -1)
    feeds = {
        "q": np.zeros((1, 1, 4 * 64), np.float32),
        "k": np.zeros((1, 1, 2 * 64), np.float32),
        "v": np.zeros((1, 1, 2 * 64), np.float32),
        "past_key": np.zeros((1, 2, 8, 64), np.float32),
        "past_value": np.zeros((1, 2, 8, 64), np.float32),
        "seqlens": np.array([8], np.int32),  # position 8 of a cache of 8
        "total": np.array(9, np.int32),
        "bias": np.zeros((1, 1, 1, 9), np.float32),
    }
    with pytest.raises(Exception, match="CacheAttention: seqlens_k 8 puts the call's tokens outside the cache's 8 positions"):
        session.run(None, feeds)
