"""The mixed step: one call that prefills a prompt chunk and decodes the running rows.

An in-place graph (``--target ort-cpu`` / ``ort-cuda``: GroupQueryAttention over a cache
bound by address) runs a prompt chunk at batch 1 or a decode step at batch ``rows``, one
call each: GroupQueryAttention takes several new tokens over a past only at batch 1. So
while a chunk is prefilled every running stream waits, and the two calls each read every
weight. :func:`mixed_step` derives a graph that does both in one call, as vLLM's
scheduler does: the chunk's ``P`` tokens and the ``R`` decode rows' tokens are packed
into one sequence of ``P + R`` tokens at batch 1, so the projections, norms and MLP run
once over all of them (one GEMM where there were a GEMM and a GEMV); only attention is
split, per layer:

- the first ``P`` tokens: the layer's own GroupQueryAttention at batch 1 over the
  prompt's slot (``past.*`` / ``present.*``, ``attention_mask`` as in a prefill call);
- the last ``R`` tokens, transposed to ``[R, 1, hidden]``: a twin GroupQueryAttention
  over the decode rows (``decode.past.*`` / ``decode.present.*``, lengths and padding
  bias from ``decode.attention_mask`` [R, capacity], as in a decode call);

and the two outputs are concatenated back into token order. The logits are those of the
last ``R + 1`` positions (the chunk's last token, then each decode row) as ``[R + 1, 1,
V]``, or of every position in an ``--all-logits`` graph (``[1, P + R, V]``). Both attention halves view one cache buffer: the
runner binds the prompt's slot and the decode rows ``0..R-1`` by address, and a decode
row that is not running (the prompt's own slot among them) writes its one harmless row
where nothing real is written in that call.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ._masks import is_mask_where, mask_lengths
from .errors import PassInputError
from .shared_buffer_cache import PADDING_BIAS, padding_bias
from .values import ints
from .vocabulary import GROUP_QUERY_ATTENTION, MS_DOMAIN

DECODE_PREFIX = "decode."  # the decode half's inputs and outputs: decode.attention_mask, decode.past.*, decode.present.*
_INT64_MAX = np.iinfo(np.int64).max
# what a padding condition may be made of: per-element tests of the mask's values
_ELEMENTWISE = {"Cast", "Unsqueeze", "Equal", "Not", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Identity"}


class MixedStepError(PassInputError):
    """The graph is not an in-place graph whose attention the mixed step can split."""


def _input(graph: ir.Graph, name: str) -> ir.Value:
    for value in graph.inputs:
        if value.name == name:
            return value
    raise MixedStepError(f"the graph has no {name} input; the mixed step needs an in-place export's prefill graph")


def _dim(graph: ir.Graph, value: ir.Value, axis: int) -> ir.Value:
    """``Shape(value)[axis:axis+1]``, int64 [1]."""
    node = ir.node("Shape", [value], attributes={"start": axis, "end": axis + 1})
    graph.append(node)
    return node.outputs[0]


def _op(graph: ir.Graph, op_type: str, inputs: list[ir.Value | None], **attributes: int | list[int]) -> ir.Value:
    node = ir.node(op_type, inputs, attributes=attributes)
    graph.append(node)
    return node.outputs[0]


def mixed_step(model: ir.Model, *, all_logits: bool = False) -> ir.Model:
    """Turn an in-place prefill graph into the mixed step's graph (see the module docstring), in place.

    ``all_logits``: the graph gives every position's logits (an ``--all-logits`` export);
    else its last position must be the one ``GatherElements`` kvexport's exporter writes.
    Raises :class:`MixedStepError` when the graph has no in-place GroupQueryAttention, an
    attention the split would change (rotary inside the op, a bias other than the padding
    bias) or a last position it can't widen; the model may then be half changed.
    """
    graph = model.graph
    attention = [n for n in graph if n.op_type == GROUP_QUERY_ATTENTION and n.domain == MS_DOMAIN]
    if not attention:
        raise MixedStepError("the graph has no GroupQueryAttention; the mixed step needs an in-place export (--target ort-cpu or ort-cuda)")
    input_ids = _input(graph, "input_ids")
    decode_mask = ir.Value(
        name=f"{DECODE_PREFIX}attention_mask", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["rows", "capacity"])
    )
    graph.inputs.append(decode_mask)

    total_tokens = _dim(graph, input_ids, 1)  # P + R
    rows = _dim(graph, decode_mask, 0)  # R
    prompt_tokens = _op(graph, "Sub", [total_tokens, rows])  # P

    seqlens, total = mask_lengths(graph, decode_mask)
    seqlens.name, total.name = f"{DECODE_PREFIX}seqlens_k", f"{DECODE_PREFIX}total_sequence_length"
    biases: dict[ir.DataType, ir.Value] = {}

    for node in attention:
        _split_attention(graph, node, prompt_tokens, seqlens, total, biases)
    _last_positions(graph, rows, all_logits)
    graph.sort()
    return model


def _split_attention(
    graph: ir.Graph,
    node: ir.Node,
    prompt_tokens: ir.Value,
    seqlens: ir.Value,
    total: ir.Value,
    biases: dict[ir.DataType, ir.Value],
) -> None:
    """The layer's attention on the first ``P`` tokens, and a twin over the decode rows on the rest."""
    zero, axis1, axis2, end = ints(graph, [0]), ints(graph, [1]), ints(graph, [2]), ints(graph, [_INT64_MAX])
    inputs = list(node.inputs) + [None] * max(0, 11 - len(node.inputs))
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    if attributes.get("do_rotary", 0):
        raise MixedStepError(f"{node.name}: rotary inside GroupQueryAttention takes positions from the cache; the mixed step needs it outside")
    if any(value is not None for value in inputs[7:10]):
        raise MixedStepError(f"{node.name}: GroupQueryAttention with cos/sin caches or position_ids cannot be split by the mixed step")
    past_key, past_value, bias = inputs[3], inputs[4], inputs[10]
    if past_key is None or past_value is None or past_key not in graph.inputs or past_value not in graph.inputs:
        raise MixedStepError(f"{node.name}: its past is not a graph input; the mixed step needs an in-place export")
    if bias is not None and not _is_padding_bias(graph, bias):
        raise MixedStepError(f"{node.name}: its attention bias is not the padding bias; the mixed step cannot split it")

    decoded: list[ir.Value | None] = []
    for index in range(3):
        value = inputs[index]
        if value is None:
            decoded.append(None)
            continue
        first = _op(graph, "Slice", [value, zero, prompt_tokens, axis1])
        rest = _op(graph, "Slice", [value, prompt_tokens, end, axis1])
        decoded.append(_op(graph, "Transpose", [rest], perm=[1, 0, 2]))  # [1, R, h] -> [R, 1, h]
        node.replace_input_with(index, first)
    if bias is not None:
        node.replace_input_with(10, _op(graph, "Slice", [bias, zero, prompt_tokens, axis2]))  # [1, 1, P, total]
        if bias.dtype not in biases:
            assert bias.dtype is not None
            biases[bias.dtype] = _decode_bias(graph, bias.dtype)

    pasts = []
    for past in (past_key, past_value):
        decode_past = ir.Value(name=DECODE_PREFIX + (past.name or ""), type=past.type, shape=ir.Shape(["rows", *list(past.shape or [])[1:]]))
        graph.inputs.append(decode_past)
        pasts.append(decode_past)
    # the rest as the layer's own: no rotary inputs, then head_sink, k_scale, v_scale (a quantized cache's scales)
    twin_inputs = [*decoded, *pasts, seqlens, total, *inputs[7:10], biases[bias.dtype] if bias is not None and bias.dtype else None, *inputs[11:]]
    while twin_inputs and twin_inputs[-1] is None:
        twin_inputs.pop()
    twin = ir.node(GROUP_QUERY_ATTENTION, twin_inputs, attributes=attributes, domain=MS_DOMAIN, num_outputs=3)
    twin.name = f"{node.name}.decode"
    graph.insert_after(node, twin)
    for present, twin_present in zip(node.outputs[1:3], twin.outputs[1:3], strict=True):
        twin_present.name = DECODE_PREFIX + (present.name or "")
        twin_present.type = present.type
        twin_present.shape = ir.Shape(["rows", *list(present.shape or [])[1:]])
        graph.outputs.append(twin_present)

    output = node.outputs[0]
    back = ir.node("Transpose", [twin.outputs[0]], attributes={"perm": [1, 0, 2]})  # [R, 1, h] -> [1, R, h]
    joined = ir.node("Concat", [output, back.outputs[0]], attributes={"axis": 1})
    graph.insert_after(twin, [back, joined])
    for use in list(output.uses()):
        if use.node is not joined:
            use.node.replace_input_with(use.idx, joined.outputs[0])


def _is_padding_bias(graph: ir.Graph, bias: ir.Value) -> bool:
    """Whether ``bias`` is the mask's padding as a bias, the same for every query: ``[Expand](Where(f(attention_mask), 0, lowest))``.

    Such a bias is split by slicing its query rows, and the twin's is rebuilt from
    ``decode.attention_mask``. One that also depends on the query's position (a causal or
    windowed mask, as other exporters build) would be wrong for the packed tokens, so only
    a ``Where`` of per-element tests of ``attention_mask``'s values qualifies.
    """
    if bias.name == PADDING_BIAS:
        return True
    producer = bias.producer()
    if producer is not None and producer.op_type == "Expand" and producer.inputs[0] is not None:
        producer = producer.inputs[0].producer()
    if not is_mask_where(producer):
        return False
    assert producer is not None
    mask = _input(graph, "attention_mask")
    pending, seen = [producer.inputs[0]], set()
    while pending:  # every value the condition reads: elementwise tests of the mask's values alone
        value = pending.pop()
        if value is None or value in seen or value.const_value is not None:
            continue
        seen.add(value)
        node = value.producer()
        if node is None:
            if value is not mask:
                return False
            continue
        if node.op_type not in _ELEMENTWISE or node.domain not in ("", "ai.onnx"):
            return False  # a CumSum, Range or Shape: a window or a causal mask, not padding
        pending.extend(node.inputs)
    return True


def _decode_bias(graph: ir.Graph, dtype: ir.DataType) -> ir.Value:
    """The decode rows' padding bias, [R, 1, 1, capacity], from ``decode.attention_mask``."""
    mask = _input(graph, f"{DECODE_PREFIX}attention_mask")
    one_query = ir.Value(name="kvexport.mixed.one_query", shape=ir.Shape(["rows", 1]))  # read for its shape only: one query per row
    bias = padding_bias(graph, mask, one_query, dtype)
    bias.name = f"{DECODE_PREFIX}padding_bias.{dtype.name.lower()}"
    return bias


def _last_positions(graph: ir.Graph, rows: ir.Value, all_logits: bool) -> None:
    """Logits for the last ``R + 1`` positions: the chunk's last token, then each decode row.

    The prefill graph gathers each row's last real token (one ``GatherElements`` on axis 1
    before the LM head, whose reshapes then hold one row per batch entry); here that is
    the slice ``[-(R+1):]``, transposed so the positions are the batch: logits
    ``[R + 1, 1, V]``. An ``--all-logits`` graph has no such gather and keeps every
    position: ``[1, P + R, V]``.
    """
    gathers = [n for n in graph if n.op_type == "GatherElements" and n.attributes.get_int("axis", 0) == 1]
    if len(gathers) > 1:
        raise MixedStepError(f"the graph gathers along the sequence {len(gathers)} times; the mixed step expects one last-position gather")
    if all_logits:
        if gathers:
            raise MixedStepError("the graph gathers a last position, but its manifest says it gives every position's logits")
        return
    if not gathers:
        raise MixedStepError(
            "the graph's last position is not the GatherElements kvexport's exporter writes (an imported graph?); "
            "the mixed step can't widen it"
        )
    for graph_output in graph.outputs:  # the LM head keeps one row per batch entry: the positions become the batch
        if graph_output.name == "logits" and graph_output.shape is not None and len(graph_output.shape) == 3:
            graph_output.shape = ir.Shape(["positions", 1, graph_output.shape[2]])
    gather = gathers[0]
    count = _op(graph, "Add", [rows, ints(graph, [1])])
    start = _op(graph, "Neg", [count])
    data = gather.inputs[0]
    assert data is not None
    last = ir.node("Slice", [data, start, ints(graph, [_INT64_MAX]), ints(graph, [1])])
    rows_first = ir.node("Transpose", [last.outputs[0]], attributes={"perm": [1, 0, 2]})  # [1, R+1, h] -> [R+1, 1, h]
    graph.insert_before(gather, [last, rows_first])
    output = gather.outputs[0]
    for use in list(output.uses()):
        use.node.replace_input_with(use.idx, rows_first.outputs[0])
