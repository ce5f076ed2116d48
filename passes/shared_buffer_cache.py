"""shared_buffer_cache: a cache updated in place instead of copied every step.

With ``MultiHeadAttention`` (or any past -> Concat -> present graph) each decode step
copies the whole cache into a new, one-longer present tensor: at 1,000 tokens of
context that is as many bytes again as the step reads. This pass rewrites every
``com.microsoft.MultiHeadAttention`` with past/present into
``com.microsoft.GroupQueryAttention`` (with ``kv_num_heads = num_heads``) over a
fixed-capacity buffer that past and present share::

    MultiHeadAttention(q, k, v, -, -, mask_bias, past.l.key, past.l.value)
      -> GroupQueryAttention(q, k, v, past.l.key, past.l.value, seqlens_k, total_sequence_length,
                             attention_bias=mask_bias)

The caller binds ``present.l.key`` to the same buffer as ``past.l.key``; the op then
reads the cache and writes only the new rows. The IO contract changes, and the manifest
says so (``cache.layout = "shared-buffer"``):

- ``past.<l>.key|value`` and ``present.<l>.key|value`` are [batch, H, max_sequence, D]:
  the buffer's capacity, not the valid length;
- the prefill graph gains the same ``past.*`` inputs (the empty buffers it fills);
- each row's valid length comes from ``attention_mask``: ``seqlens_k`` (the index of the
  row's last 1) and ``total_sequence_length`` (the mask's width) are computed from it once
  per graph, so there are no new inputs. Rows may end at different places: left-padded
  batches, right-padded prompts and slots of different lengths decoding together (the
  mask as wide as the buffer) all work. ``total_sequence_length`` comes from the mask's
  shape (GroupQueryAttention reads it on the host); ``seqlens_k`` from the mask tensor
  itself, so on CUDA it is computed on the device and no host-to-device copy runs inside
  the graph.
- the attention bias: GroupQueryAttention masks causally itself, so when the exporter's
  bias is a pure mask (``Where(cond, 0, lowest or -inf)``: the causal-and-padding mask
  every GPT-2 export builds) it is replaced by the padding part alone,
  ``Where(attention_mask, 0, lowest)`` as [batch, 1, sequence, total]. That drops the
  exporter's mask-building chain (Shape/Range/GatherND on the host under CUDA, and the
  copies back to the device) from both graphs. Any other bias is kept as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import TopologicalSortPass

from ._masks import is_mask_where, mask_dim, mask_lengths, padding_condition
from .cache_names import canonical_slot
from .errors import PassInputError
from .values import initializer, take_graph_output
from .vocabulary import GQA_MARK, GROUP_QUERY_ATTENTION, MS_DOMAIN, MULTI_HEAD_ATTENTION

CAPACITY_DIM = "max_sequence"
PADDING_BIAS = "kvexport.padding_bias"  # the name of padding_bias's value: a bias that needs no replacing
TOTAL_DIM = "total_sequence"


class SharedBufferCacheError(PassInputError):
    """The graph can't be given a shared-buffer cache (no attention_mask, unexpected MHA inputs)."""


def _read_token_shape_from_queries(graph: ir.Graph, mask: ir.Value, queries: ir.Value, total: ir.Value) -> None:
    """Point every read of ``Shape(mask)`` but ``total``'s at ``Shape(queries)``, the same slice."""
    keep: set[ir.Node] = set()
    value: ir.Value | None = total
    while value is not None and value is not mask and (producer := value.producer()) is not None:
        keep.add(producer)
        value = producer.inputs[0]
    for use in list(mask.uses()):
        shape = use.node
        if shape.op_type != "Shape" or shape.domain not in ("", "ai.onnx"):
            continue
        uses = list(shape.outputs[0].uses())
        moved = [u for u in uses if u.node not in keep]
        if not moved:
            continue
        if len(moved) == len(uses):  # only the exporter reads it: read the tokens instead
            shape.replace_input_with(0, queries)
            continue
        twin = ir.node("Shape", [queries], attributes={k: a.value for k, a in shape.attributes.items()})
        graph.insert_after(shape, twin)
        for consumer in moved:
            consumer.node.replace_input_with(consumer.idx, twin.outputs[0])


def padding_bias(graph: ir.Graph, mask: ir.Value, queries: ir.Value | None, dtype: ir.DataType) -> ir.Value:
    """``Where(attention_mask, 0, lowest)`` as [batch, 1, sequence, total] of ``dtype``.

    ``queries`` is the ``input_ids`` input: where its length is not statically 1 (prefill)
    the [batch, 1, 1, total] mask is expanded along the query axis, as GroupQueryAttention
    wants; the Expand's shape is host data under CUDA and needs no copy.
    """
    numpy_dtype = dtype.numpy()
    created: list[ir.Node] = []
    nodes, condition = padding_condition(graph, mask)
    zero = initializer(graph, "kvexport.bias_zero", np.array(0, numpy_dtype))
    lowest = initializer(graph, "kvexport.bias_lowest", np.array(np.finfo(numpy_dtype).min, numpy_dtype))
    bias = ir.node("Where", [condition, zero, lowest])
    nodes.append(bias)
    result = bias.outputs[0]
    query_dims = queries.shape if queries is not None else None
    if query_dims is None or len(query_dims) < 2 or query_dims[1] != 1:
        if queries is None:
            raise SharedBufferCacheError("the graph has no input_ids input to take the query length from")
        query_length = mask_dim(graph, queries, 1, created)
        ones = initializer(graph, "kvexport.ones_1_1", np.array([1, 1], np.int64))
        one = initializer(graph, "kvexport.ones_1", np.array([1], np.int64))
        shape = ir.node("Concat", [ones, query_length, one], attributes={"axis": 0})
        expanded = ir.node("Expand", [result, shape.outputs[0]])
        nodes += [shape, expanded]
        result = expanded.outputs[0]
    result.name = PADDING_BIAS
    result.type = ir.TensorType(dtype)
    graph.extend([*created, *nodes])
    return result


def _attention_nodes(graph: ir.Graph) -> list[ir.Node]:
    """MultiHeadAttention to convert, and GroupQueryAttention that fuse_attention made over the exporter's cache."""
    return [
        n
        for n in graph
        if n.domain == MS_DOMAIN
        and (n.op_type == MULTI_HEAD_ATTENTION or (n.op_type == GROUP_QUERY_ATTENTION and GQA_MARK in n.metadata_props))
    ]


def _input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


# where each op reads its past and its attention bias
_PAST_AT = {MULTI_HEAD_ATTENTION: 6, GROUP_QUERY_ATTENTION: 3}
_BIAS_AT = {MULTI_HEAD_ATTENTION: 5, GROUP_QUERY_ATTENTION: 10}


def _optional_input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if len(node.inputs) > index else None


class SharedBufferCachePass(InPlacePass):
    """MultiHeadAttention with a cache -> GroupQueryAttention over shared past/present buffers.

    GroupQueryAttention that :mod:`passes.fuse_grouped_attention` fused over the exporter's
    past and present (grouped-query models: fewer cache heads than query heads) is kept and
    given the same buffers. ``counts["attention_converted"]`` and ``counts["attention_adopted"]``
    say how many ops were rewritten; a graph with neither is left unmodified.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def requires(self, model: ir.Model) -> None:
        """What the rewrite needs of the graph; raises :class:`SharedBufferCacheError` otherwise.

        An ``attention_mask`` input, and each MultiHeadAttention without bias /
        key_padding_mask inputs and with canonical ``present.<l>.key|value`` outputs.
        """
        attention = _attention_nodes(model.graph)
        if not attention:
            return
        if _input(model.graph, "attention_mask") is None:
            raise SharedBufferCacheError("the graph has no attention_mask input to take lengths from")
        for node in attention:
            if node.op_type == MULTI_HEAD_ATTENTION and (any(v is not None for v in node.inputs[3:5]) or len(node.inputs) > 8):
                raise SharedBufferCacheError(
                    f"{node.name}: MultiHeadAttention with bias / key_padding_mask inputs is not supported"
                )
            slots = [canonical_slot(o.name or "") for o in node.outputs[1:3]]
            if len(node.outputs) < 3 or not all(s is not None and s.direction == "present" for s in slots):
                raise SharedBufferCacheError(f"{node.name}: its presents are not present.<l>.key|value outputs")
            bias = _optional_input(node, _BIAS_AT[node.op_type])
            if bias is not None and is_mask_where(bias.producer()) and _input(model.graph, "input_ids") is None:
                raise SharedBufferCacheError("the graph has no input_ids input to take the query length from")

    def call(self, model: ir.Model) -> PassResult:
        """Rewrite in place (what :meth:`requires` checked holds)."""
        graph = model.graph
        attention = _attention_nodes(graph)
        self.counts = {"attention_converted": 0, "attention_adopted": 0}
        mask = _input(graph, "attention_mask")
        if not attention or mask is None:
            return PassResult(model, modified=False)
        lengths: list[tuple[ir.Value, ir.Value]] = []
        queries = _input(graph, "input_ids")
        padding: dict[ir.DataType, ir.Value] = {}
        self.counts["bias_replaced"] = 0
        new_inputs: list[ir.Value] = []
        total: ir.Value | None = None
        for node in attention:
            present_key = node.outputs[1]
            slot = canonical_slot(present_key.name or "")
            assert slot is not None  # requires() checked every present name
            heads = node.attributes.get_int("kv_num_heads" if node.op_type == GROUP_QUERY_ATTENTION else "num_heads")
            head_dim = present_key.shape[3] if present_key.shape is not None else None
            shape = ir.Shape(["batch", heads, CAPACITY_DIM, head_dim])
            past: list[ir.Value] = []
            for index, kind in enumerate(("key", "value")):
                existing = _optional_input(node, _PAST_AT[node.op_type] + index)
                if existing is None or existing.producer() is not None:  # none, or an empty past made in the graph
                    existing = ir.Value(name=f"past.{slot.layer}.{kind}", shape=shape, type=present_key.type)
                    new_inputs.append(existing)
                existing.shape = shape
                past.append(existing)
            bias = _optional_input(node, _BIAS_AT[node.op_type])
            mask_bias = bias is not None and is_mask_where(bias.producer()) and bias.name != PADDING_BIAS
            if bias is not None and mask_bias and node.inputs[0] is not None and node.inputs[0].dtype is not None:
                dtype = node.inputs[0].dtype
                if dtype not in padding:
                    padding[dtype] = padding_bias(graph, mask, queries, dtype)
                bias = padding[dtype]
                self.counts["bias_replaced"] += 1
            if node.op_type == GROUP_QUERY_ATTENTION:  # fused already: the buffers and the bias are all that change
                # Lengths made here, after the shape folding: in a prefill graph the mask's width and
                # the tokens' length share a dim name, so a length made before may read the tokens'.
                # (onnxruntime-genai's count the mask's ones, which a left-padded row gets wrong.)
                if not lengths:
                    lengths.append(mask_lengths(graph, mask))
                node.replace_input_with(5, lengths[0][0])
                node.replace_input_with(6, lengths[0][1])
                # The exporter's bias was made for its own cache (its causal part counts the past it
                # was given, none in a prefill graph); over the buffer the op masks causally itself,
                # so the padding is all the bias says (a sliding window is the op's local_window_size).
                dtype = node.inputs[0].dtype if node.inputs[0] is not None and node.inputs[0].dtype else ir.DataType.FLOAT
                if dtype not in padding:
                    padding[dtype] = padding_bias(graph, mask, queries, dtype)
                bias = padding[dtype]
                total = _adopt(node, past, bias, shape)
                self.counts["attention_adopted"] += 1
                continue
            if not lengths:
                lengths.append(mask_lengths(graph, mask))
            total = lengths[0][1]
            attributes: dict[str, int | float] = {"num_heads": heads or 1, "kv_num_heads": heads or 1}
            scale = node.attributes.get_float("scale", 0.0)
            if scale:
                attributes["scale"] = scale
            inputs = [*node.inputs[:3], *past, *lengths[0], None, None, None, bias]
            gqa = ir.node(GROUP_QUERY_ATTENTION, inputs, attributes=attributes, domain=MS_DOMAIN, num_outputs=3)
            graph.insert_after(node, gqa)
            for old, new in zip(node.outputs[:3], gqa.outputs, strict=True):
                new.shape, new.type = old.shape, old.type
                if old.is_graph_output():
                    take_graph_output(graph, old, new, shape)
                ir.convenience.replace_all_uses_with(old, new)
            graph.remove(node, safe=True)
            self.counts["attention_converted"] += 1
        if new_inputs:
            new_inputs.sort(key=lambda v: (int((v.name or "").split(".")[1]), v.name))
            graph.inputs.extend(new_inputs)
        assert total is not None  # there was an op to convert or adopt
        self.counts["mask_dim_separated"] = int(_separate_mask_dim(graph, mask, queries, total))
        TopologicalSortPass()(model)  # the length nodes were appended; put them before their users
        return PassResult(model, modified=True)


def _adopt(node: ir.Node, past: list[ir.Value], bias: ir.Value | None, shape: ir.Shape) -> ir.Value:
    """A fused GroupQueryAttention reads and writes the shared buffers ``past`` (and ``bias``); returns its total length."""
    if len(node.inputs) < 11:
        node.resize_inputs(11)
    node.replace_input_with(3, past[0])
    node.replace_input_with(4, past[1])
    node.replace_input_with(10, bias)
    for present in node.outputs[1:3]:
        present.shape = shape
    del node.metadata_props[GQA_MARK]
    total = node.inputs[6]
    assert total is not None
    return total


def _separate_mask_dim(graph: ir.Graph, mask: ir.Value, queries: ir.Value | None, total: ir.Value) -> bool:
    """Give the mask's width a dim of its own where the exporter named it as the tokens' length.

    With the in-place cache the mask spans the cache (a prompt chunk after a past, one token
    over a mask as wide as the buffer), so ``attention_mask`` [batch, sequence] beside
    ``input_ids`` [batch, sequence] would tell ONNX Runtime that two different sizes are
    equal, and its planner may then reuse one's buffer for the other. The mask becomes
    [batch, total_sequence], and the shapes the exporter noted on the values in between
    (derived under that equality) are dropped, so ONNX Runtime infers them from the inputs.
    The exporter's own reads of the mask's shape meant the tokens' (an all-logits head
    reshapes to [batch, sequence, vocab] with them): they read ``input_ids`` instead; only
    ``total`` (``total_sequence_length``) keeps reading the mask's width.
    """
    if queries is None or mask.shape is None or queries.shape is None or len(mask.shape) != 2:
        return False
    width, length = mask.shape[1], queries.shape[1]
    if not isinstance(width, ir.SymbolicDim) or str(width) != str(length):
        return False
    mask.shape = ir.Shape([mask.shape[0], TOTAL_DIM])
    _read_token_shape_from_queries(graph, mask, queries, total)
    outputs = {id(value) for value in graph.outputs}
    for node in graph.all_nodes():
        for value in node.outputs:
            if id(value) not in outputs:
                value.shape = None
    return True
