"""Grouped-query attention over an in-place cache, as one op from PyTorch to ONNX Runtime.

For the ORT targets the Llama-style families' attention is exported as ONNX Runtime's
``com.microsoft.GroupQueryAttention`` with the cache's KV heads unexpanded and past and
present sharing one buffer (the contract of ``kvexport.passes.shared_buffer_cache``). It
gets there without pattern matching on the exported graph:

- transformers' attention interface takes a function per ``_attn_implementation``;
  :func:`grouped_attention` is registered as ``kvexport_gqa`` and, while an export traces
  the model (:func:`in_place_attention`, the model run without a cache object), receives
  each layer's rotated queries and new keys and values;
- it calls the custom op ``kvexport::group_query_attention``, whose PyTorch kernel
  (:func:`_reference`) computes what ONNX Runtime's op computes, and whose ONNX translation
  (:data:`ONNX_TRANSLATION`, given to ``torch.onnx.export``) emits the op itself;
- each row's length (``seqlens_k``: the index of the last 1 in its mask), the mask's width
  (``total_sequence_length``) and the padding bias are computed once per graph from
  ``attention_mask``, exactly as the shared-buffer pass computes them for GPT-2.

Rotary positions are applied by ONNX Runtime's ``com.microsoft.RotaryEmbedding``, one op per
query and key instead of the fourteen that transformers' ``apply_rotary_pos_emb`` traces to
(slices, negations, concats, products and sums): while the export traces,
:func:`in_place_attention` puts :func:`rotary_embedding` in place of the modeling file's
``apply_rotary_pos_emb``. The cosines and sines stay the model's own, computed once per graph
from ``position_ids`` by its rotary module (llama3 scaling, longrope's short and long factors,
the attention scaling all included); the op reads them as a table of ``batch x sequence``
rows, one per token, so rows of different lengths (left-padded batches, slots) each keep
their own positions.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from kvexport.passes.vocabulary import GROUP_QUERY_ATTENTION, MS_DOMAIN, ROTARY_EMBEDDING

IMPLEMENTATION = "kvexport_gqa"


@torch.library.custom_op("kvexport::group_query_attention", mutates_args=())
def group_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_sequence_length: torch.Tensor,
    attention_bias: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    local_window_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONNX Runtime's GroupQueryAttention over a shared buffer (see :func:`_reference`)."""
    return _reference(
        query, key, value, past_key, past_value, seqlens_k, attention_bias, num_heads, kv_num_heads, scale, local_window_size
    )


@group_query_attention.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_sequence_length: torch.Tensor,
    attention_bias: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    local_window_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


def _reference(
    query: torch.Tensor,  # [batch, sequence, H * D]
    key: torch.Tensor,  # [batch, sequence, KV * D]
    value: torch.Tensor,
    past_key: torch.Tensor,  # [batch, KV, capacity, D], the shared buffer
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,  # [batch] int32: the index of each row's last token
    attention_bias: torch.Tensor,  # [batch, 1, sequence, total]
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    local_window_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ONNX Runtime's kernel computes, row by row, in plain PyTorch.

    Row ``b``'s ``sequence`` new rows are written at ``seqlens_k[b] + 1 - sequence ..
    seqlens_k[b]`` of the buffer; query ``i`` attends causally over the buffer up to its
    own position (and, with ``local_window_size`` >= 0, over the last ``local_window_size``
    positions, its own included), with the padding bias added, each KV head serving ``num_heads //
    kv_num_heads`` query heads.
    """
    batch, sequence, _ = query.shape
    head_dim = past_key.shape[-1]
    total = attention_bias.shape[-1]
    present_key, present_value = past_key.clone(), past_value.clone()
    outputs = []
    for row in range(batch):
        end = int(seqlens_k[row]) + 1
        start = end - sequence
        present_key[row, :, start:end] = key[row].view(sequence, kv_num_heads, head_dim).transpose(0, 1)
        present_value[row, :, start:end] = value[row].view(sequence, kv_num_heads, head_dim).transpose(0, 1)
        group = num_heads // kv_num_heads
        keys = present_key[row, :, :total].repeat_interleave(group, dim=0)  # [H, total, D]
        values = present_value[row, :, :total].repeat_interleave(group, dim=0)
        queries = query[row].view(sequence, num_heads, head_dim).transpose(0, 1)  # [H, sequence, D]
        scores = queries.float() @ keys.float().transpose(1, 2) * scale + attention_bias[row].float()
        positions = torch.arange(total, device=query.device)
        own = (start + torch.arange(sequence, device=query.device))[:, None]
        causal = positions[None, :] <= own
        if local_window_size >= 0:
            causal &= positions[None, :] > own - local_window_size
        scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
        weights = torch.softmax(scores, dim=-1)
        outputs.append((weights @ values.float()).transpose(0, 1).reshape(sequence, num_heads * head_dim))
    return torch.stack(outputs).to(query.dtype), present_key, present_value


def _onnx_group_query_attention(
    query: Any,
    key: Any,
    value: Any,
    past_key: Any,
    past_value: Any,
    seqlens_k: Any,
    total_sequence_length: Any,
    attention_bias: Any,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    local_window_size: int = -1,
) -> Any:
    from onnxscript.values import Op, Opset

    group_query = Op(Opset(MS_DOMAIN, 1), GROUP_QUERY_ATTENTION, op_schema=_gqa_schema())
    return group_query(
        query,
        key,
        value,
        past_key,
        past_value,
        seqlens_k,
        total_sequence_length,
        None,  # cos_cache: the queries and keys come rotated (RotaryEmbedding)
        None,  # sin_cache
        None,  # position_ids
        attention_bias,
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        scale=scale,
        local_window_size=local_window_size,
    )


def _gqa_schema() -> Any:
    """The part of ``com.microsoft.GroupQueryAttention``'s schema kvexport uses (onnx registers none for contrib ops).

    Inputs and attributes in ONNX Runtime's order (``contrib_ops/core/graph/contrib_ops``);
    it stays local to the translation, nothing is registered with onnx.
    """
    from onnx.defs import OpSchema

    optional = OpSchema.FormalParameterOption.Optional
    names = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
             "cos_cache", "sin_cache", "position_ids", "attention_bias")
    types = {"seqlens_k": "M", "total_sequence_length": "M", "position_ids": "P", "past_key": "T_CACHE", "past_value": "T_CACHE"}
    required = {"query", "seqlens_k", "total_sequence_length"}
    inputs = [
        OpSchema.FormalParameter(name, types.get(name, "T"), param_option=OpSchema.FormalParameterOption.Single if name in required else optional)
        for name in names
    ]
    outputs = [
        OpSchema.FormalParameter("output", "T"),
        OpSchema.FormalParameter("present_key", "T_CACHE"),
        OpSchema.FormalParameter("present_value", "T_CACHE"),
    ]
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    return OpSchema(
        GROUP_QUERY_ATTENTION,
        MS_DOMAIN,
        1,
        inputs=inputs,
        outputs=outputs,
        type_constraints=[
            ("T", floats, ""),
            ("T_CACHE", [*floats, "tensor(int8)", "tensor(uint8)"], ""),
            ("M", ["tensor(int32)"], ""),
            ("P", ["tensor(int64)"], ""),
        ],
        attributes=[
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "", required=False),
            OpSchema.Attribute("local_window_size", OpSchema.AttrType.INT, "", required=False),
        ],
    )


@torch.library.custom_op("kvexport::rotary_embedding", mutates_args=())
def rotary_table(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` [batch, sequence, heads * D] rotated by the angles of the table rows that ``rows`` [batch, sequence] names.

    ``cos_table`` and ``sin_table`` are [N, D / 2]: row ``rows[b, s]`` holds token ``(b, s)``'s
    angles. The result is transformers' ``x * cos + rotate_half(x) * sin`` for each head, exactly.
    """
    batch, sequence, width = x.shape
    half = cos_table.shape[-1]
    heads = x.view(batch, sequence, width // (2 * half), 2 * half)
    cos = cos_table[rows].unsqueeze(2)  # [batch, sequence, 1, D / 2]
    sin = sin_table[rows].unsqueeze(2)
    first, second = heads.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).view(batch, sequence, width)


@rotary_table.register_fake
def _(x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _onnx_rotary_embedding(x: Any, cos_table: Any, sin_table: Any, rows: Any) -> Any:
    from onnxscript.values import Op, Opset

    rotary = Op(Opset(MS_DOMAIN, 1), ROTARY_EMBEDDING, op_schema=_rotary_schema())
    return rotary(x, rows, cos_table, sin_table, interleaved=0)


def _rotary_schema() -> Any:
    """The part of ``com.microsoft.RotaryEmbedding``'s schema kvexport uses, local to the translation."""
    from onnx.defs import OpSchema

    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    return OpSchema(
        ROTARY_EMBEDDING,
        MS_DOMAIN,
        1,
        inputs=[
            OpSchema.FormalParameter("input", "T"),
            OpSchema.FormalParameter("position_ids", "M"),
            OpSchema.FormalParameter("cos_cache", "T"),
            OpSchema.FormalParameter("sin_cache", "T"),
        ],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", floats, ""), ("M", ["tensor(int64)"], "")],
        attributes=[OpSchema.Attribute("interleaved", OpSchema.AttrType.INT, "", required=False)],
    )


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb`` as two :func:`rotary_table` ops, while an in-place export traces.

    ``cos`` and ``sin`` are the model's [batch, sequence, D] (both halves equal); their first
    halves become the op's table, computed once per graph (every layer gets the same tensors).
    Partial rotary dimensions and other layouts keep the modeling file's own function.
    """
    layers: _Layers = _ACTIVE.layers
    head_dim = q.shape[-1]
    if unsqueeze_dim != 1 or cos.dim() != 3 or cos.shape[-1] != head_dim or cos.shape[0] != q.shape[0]:
        return layers.rotary_fallback(q, k, cos, sin, unsqueeze_dim)
    if layers.rotary is None or layers.rotary[0] is not cos:
        batch, sequence = cos.shape[0], cos.shape[1]
        half = head_dim // 2
        rows = torch.arange(batch * sequence, device=cos.device).view(batch, sequence)
        layers.rotary = (cos, cos[..., :half].reshape(batch * sequence, half), sin[..., :half].reshape(batch * sequence, half), rows)
    _, cos_table, sin_table, rows = layers.rotary

    def rotated(x: torch.Tensor) -> torch.Tensor:
        # in the [batch, sequence, heads * D] layout GroupQueryAttention takes: the transposes
        # to and from the modeling file's [batch, heads, sequence, D] cancel in the graph
        batch, heads, sequence, _ = x.shape
        flat = rotary_table(x.transpose(1, 2).reshape(batch, sequence, heads * head_dim), cos_table, sin_table, rows)
        return flat.view(batch, sequence, heads, head_dim).transpose(1, 2)

    return rotated(q), rotated(k)


# what torch.onnx.export(custom_translation_table=...) needs to emit the op
ONNX_TRANSLATION: dict[Any, Any] = {
    torch.ops.kvexport.group_query_attention.default: _onnx_group_query_attention,
    torch.ops.kvexport.rotary_embedding.default: _onnx_rotary_embedding,
}


@dataclass
class _Layers:
    """One traced call's in-place buffers and what each layer's attention needs."""

    past: list[tuple[torch.Tensor, torch.Tensor]]
    seqlens_k: torch.Tensor
    total_sequence_length: torch.Tensor
    attention_bias: torch.Tensor
    present: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # the modeling file's own apply_rotary_pos_emb, and the table built from this call's cos and sin
    rotary_fallback: Any = None
    rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


_ACTIVE = threading.local()


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, H, sequence, D], rotated
    key: torch.Tensor,  # [batch, KV, sequence, D], rotated
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention function ``kvexport_gqa``: the layer's attention as the custom op."""
    layers: _Layers = _ACTIVE.layers
    layer = int(getattr(module, "layer_idx", 0))
    batch, heads, sequence, head_dim = query.shape
    kv_heads = key.shape[1]
    past_key, past_value = layers.past[layer]
    output, present_key, present_value = torch.ops.kvexport.group_query_attention(
        query.transpose(1, 2).reshape(batch, sequence, heads * head_dim),
        key.transpose(1, 2).reshape(batch, sequence, kv_heads * head_dim),
        value.transpose(1, 2).reshape(batch, sequence, kv_heads * head_dim),
        past_key,
        past_value,
        layers.seqlens_k,
        layers.total_sequence_length,
        layers.attention_bias,
        heads,
        kv_heads,
        float(scaling if scaling is not None else head_dim**-0.5),
        _window(kwargs.get("sliding_window")),
    )
    layers.present[layer] = (present_key, present_value)
    return output.view(batch, sequence, heads, head_dim), None


def _window(sliding_window: int | None) -> int:
    """GroupQueryAttention's ``local_window_size`` for transformers' ``sliding_window`` (-1: none).

    The same number: both see the last ``sliding_window`` positions, the query's own included
    (ONNX Runtime 1.23 and later, onnxruntime#25927; verify compares them past the window).
    """
    return -1 if sliding_window is None else int(sliding_window)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask interface for ``kvexport_gqa``: the op masks causally itself, the padding comes as a bias."""
    return None


AttentionInterface.register(IMPLEMENTATION, grouped_attention)
AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)


def lengths_and_bias(
    attention_mask: torch.Tensor, sequence: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``seqlens_k`` (index of each row's last 1), ``total_sequence_length`` and the padding bias [batch, 1, sequence, total]."""
    width = attention_mask.shape[1]
    counted = torch.arange(1, width + 1, device=attention_mask.device)
    seqlens_k = ((attention_mask * counted).amax(-1) - 1).to(torch.int32)
    total = torch.ones((), dtype=torch.int32) * width
    lowest = torch.finfo(dtype).min
    bias = torch.where(attention_mask[:, None, None, :] != 0, 0.0, lowest).to(dtype)
    return seqlens_k, total, bias.expand(attention_mask.shape[0], 1, sequence, width)


@contextlib.contextmanager
def in_place_attention(
    model: PreTrainedModel, past: list[tuple[torch.Tensor, torch.Tensor]], attention_mask: torch.Tensor, sequence: int
) -> Iterator[_Layers]:
    """While inside, ``model`` runs its attention as the custom op over the ``past`` buffers."""
    dtype = past[0][0].dtype
    seqlens_k, total, bias = lengths_and_bias(attention_mask, sequence, dtype)
    layers = _Layers(past, seqlens_k, total, bias)
    previous = model.config._attn_implementation
    model.config._attn_implementation = IMPLEMENTATION
    modeling = sys.modules[type(model).__module__]  # the family's modeling file, where attention looks the function up
    layers.rotary_fallback = getattr(modeling, "apply_rotary_pos_emb", None)
    _ACTIVE.layers = layers
    if layers.rotary_fallback is not None:
        modeling.apply_rotary_pos_emb = rotary_embedding  # type: ignore[attr-defined]
    try:
        yield layers
    finally:
        if layers.rotary_fallback is not None:
            modeling.apply_rotary_pos_emb = layers.rotary_fallback  # type: ignore[attr-defined]
        model.config._attn_implementation = previous
        del _ACTIVE.layers
