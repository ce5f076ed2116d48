"""The custom op's PyTorch kernel against ONNX Runtime's GroupQueryAttention it is exported as.

One ``com.microsoft.GroupQueryAttention`` node, past and present bound to one buffer as the
runtime binds them; the same inputs through ``torch.ops.kvexport.group_query_attention``.
Both the attention output and the rows written into the buffer must agree, for a
left-padded first prompt and a decode step, with and without a local window.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvexport.models import grouped_attention  # noqa: F401 - registers the op
from kvexport.models.grouped_attention import lengths_and_bias

HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 4, 2, 8, 12


def _session(window: int) -> ort.InferenceSession:
    h = onnx.helper
    floats = onnx.TensorProto.FLOAT
    inputs = [
        h.make_tensor_value_info("query", floats, ["batch", "sequence", HEADS * HEAD_DIM]),
        h.make_tensor_value_info("key", floats, ["batch", "sequence", KV_HEADS * HEAD_DIM]),
        h.make_tensor_value_info("value", floats, ["batch", "sequence", KV_HEADS * HEAD_DIM]),
        h.make_tensor_value_info("past_key", floats, ["batch", KV_HEADS, CAPACITY, HEAD_DIM]),
        h.make_tensor_value_info("past_value", floats, ["batch", KV_HEADS, CAPACITY, HEAD_DIM]),
        h.make_tensor_value_info("seqlens_k", onnx.TensorProto.INT32, ["batch"]),
        h.make_tensor_value_info("total_sequence_length", onnx.TensorProto.INT32, []),
        h.make_tensor_value_info("attention_bias", floats, ["batch", 1, "sequence", "total"]),
    ]
    outputs = [
        h.make_tensor_value_info("output", floats, None),
        h.make_tensor_value_info("present_key", floats, ["batch", KV_HEADS, CAPACITY, HEAD_DIM]),
        h.make_tensor_value_info("present_value", floats, ["batch", KV_HEADS, CAPACITY, HEAD_DIM]),
    ]
    node = h.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "", "", "", "attention_bias"],
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        scale=HEAD_DIM**-0.5,
        local_window_size=window,
    )
    graph = h.make_graph([node], "gqa", inputs, outputs)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run_ort(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One run with past and present bound to the same buffers, as the runtime binds them."""
    binding = session.io_binding()
    binding.bind_output("output")  # first: copy_outputs_to_cpu follows the binding order
    buffers, arrays = {}, {}
    for name in ("key", "value"):
        arrays[name] = feeds[f"past_{name}"].copy()  # the OrtValue wraps it without keeping it alive
        buffers[name] = ort.OrtValue.ortvalue_from_numpy(arrays[name])
        binding.bind_ortvalue_input(f"past_{name}", buffers[name])
        binding.bind_ortvalue_output(f"present_{name}", buffers[name])
    for name, value in feeds.items():
        if not name.startswith("past_"):
            binding.bind_cpu_input(name, value)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0], arrays["key"], arrays["value"]


@pytest.mark.parametrize("window", [-1, 3])
@pytest.mark.parametrize("step", ["left-padded prompt", "decode"])
def test_the_pytorch_kernel_computes_what_onnx_runtime_computes(window: int, step: str) -> None:
    rng = np.random.default_rng(0)
    if step == "left-padded prompt":  # the first prompt: as many new tokens as the mask is wide
        mask = np.array([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], np.int64)
        sequence = mask.shape[1]
        past_key = np.zeros((2, KV_HEADS, CAPACITY, HEAD_DIM), np.float32)
    else:  # one new token after a past of 6 (the second row left-padded by 2)
        mask = np.array([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]], np.int64)
        sequence = 1
        past_key = rng.normal(size=(2, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float32)
    past_value = rng.normal(size=past_key.shape).astype(np.float32) if step == "decode" else past_key.copy()
    seqlens, total, bias = (t.numpy() for t in lengths_and_bias(torch.from_numpy(mask), sequence, torch.float32))
    feeds = {
        "query": rng.normal(size=(2, sequence, HEADS * HEAD_DIM)).astype(np.float32),
        "key": rng.normal(size=(2, sequence, KV_HEADS * HEAD_DIM)).astype(np.float32),
        "value": rng.normal(size=(2, sequence, KV_HEADS * HEAD_DIM)).astype(np.float32),
        "past_key": past_key,
        "past_value": past_value,
        "seqlens_k": seqlens,
        "total_sequence_length": total,
        "attention_bias": np.ascontiguousarray(bias),
    }
    want = _run_ort(_session(window), feeds)
    tensors = {name: torch.from_numpy(value) for name, value in feeds.items()}
    got = torch.ops.kvexport.group_query_attention(
        *(tensors[name] for name in ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "attention_bias")),
        HEADS,
        KV_HEADS,
        HEAD_DIM**-0.5,
        window,
    )
    width = mask.shape[1]
    for row in range(2):
        real = mask[row].astype(bool)[-sequence:]  # the queries of real tokens (pad rows' outputs are unused)
        np.testing.assert_allclose(got[0][row].numpy()[real], want[0][row][real], rtol=1e-5, atol=1e-5)
        for index in (1, 2):  # the buffer up to the mask's width: the rows written and the past kept
            np.testing.assert_allclose(got[index][row, :, :width].numpy(), want[index][row, :, :width], rtol=1e-6, atol=1e-6)


def test_the_rotary_kernel_is_transformers_rotation_and_onnx_runtimes() -> None:
    """``kvexport::rotary_embedding`` against ``apply_rotary_pos_emb`` (llama3-scaled angles,
    left-padded positions) and against the ``com.microsoft.RotaryEmbedding`` node it becomes."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, max_position_embeddings=64,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    positions = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]) + torch.tensor([[0], [37]])  # a padded row, a late one
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, 5, HEAD_DIM, generator=generator)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    half = HEAD_DIM // 2
    tables = [t[..., :half].reshape(10, half) for t in (cos, sin)]
    rows = torch.arange(10).view(2, 5)
    flat = q.transpose(1, 2).reshape(2, 5, HEADS * HEAD_DIM)
    got = torch.ops.kvexport.rotary_embedding(flat, *tables, rows)
    torch.testing.assert_close(got.view(2, 5, HEADS, HEAD_DIM).transpose(1, 2), want, rtol=0, atol=0)  # the same arithmetic

    h = onnx.helper
    floats = onnx.TensorProto.FLOAT
    node = h.make_node("RotaryEmbedding", ["x", "rows", "cos", "sin"], ["y"], domain="com.microsoft", interleaved=0)
    graph = h.make_graph(
        [node], "rotary",
        [h.make_tensor_value_info("x", floats, [2, 5, HEADS * HEAD_DIM]), h.make_tensor_value_info("rows", onnx.TensorProto.INT64, [2, 5]),
         h.make_tensor_value_info("cos", floats, [10, half]), h.make_tensor_value_info("sin", floats, [10, half])],
        [h.make_tensor_value_info("y", floats, None)],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (onnx_out,) = session.run(None, {"x": flat.numpy(), "rows": rows.numpy(), "cos": tables[0].numpy(), "sin": tables[1].numpy()})
    np.testing.assert_allclose(onnx_out, got.numpy(), rtol=0, atol=1e-6)
