"""Grouped-query attention as other tools export it: one fused op per layer, KV heads unexpanded.

Exporters of the Llama-style families (Llama, SmolLM2, Qwen2/2.5, Qwen3, Mistral, Phi-3) leave
transformers' attention decomposed: the rotated queries and keys ``[b, H, s, D]`` /
``[b, Hkv, s, D]``, the past concatenated outside attention, and ``repeat_kv`` widening the
cache to the query heads before the product::

    present_key = Concat(past_key, k, axis=-2)                           (value alike; absent in prefill)
    keys = Reshape(Expand(Unsqueeze(present_key, [2]), [b, Hkv, H/Hkv, t, D]), [b, H, t, D])
    scores = MatMul(q, Transpose(keys, [0, 1, 3, 2])) * scale + mask_bias
    out = Transpose(MatMul(Softmax(scores), values), [0, 2, 1, 3])       # [b, s, H, D]

(``repeat_kv`` is absent when every query head has its own cache head; the scaling and the
masks take the forms :func:`_scores.attention_probs` lists.) The rule replaces it by

- ``target="ort"``: ``com.microsoft.GroupQueryAttention`` with ``kv_num_heads`` the cache's
  heads, the past as its ``past_key`` / ``past_value`` (the cache stays ``[b, Hkv, t, D]``)
  and the exporter's mask as ``attention_bias``. Each row's length (``seqlens_k``) and the
  mask's width (``total_sequence_length``) are computed once per graph from
  ``attention_mask``, as :mod:`passes.shared_buffer_cache` computes them; a graph without an
  ``attention_mask`` input is not fused (the rule says so). Past and present stay separate
  tensors (the op copies the past into a present one step longer), so the graph's IO does
  not change; ``shared_buffer_cache`` turns them into one in-place buffer where asked.
- ``target="onnx"``: the opset-23 ``Attention`` op with ``kv_num_heads``.

Queries, keys and values go in as ``[b, s, H*D]``: where the matched tensor is a
``Transpose([0, 2, 1, 3])`` of ``[b, s, H, D]`` (Qwen3's normed heads, the value projection)
that tensor is reshaped; where it is not (the rotated query and key) it is transposed
back first.

In a graph without a past (prefill) the presents are the new keys and values themselves;
the fused op's presents take over those graph outputs, so that the op writes the cache.

Before attention is fused (``target="ort"``), :class:`FuseRotary` makes transformers'
``x * cos + rotate_half(x) * sin`` (about seven ops per query and key: slices, a negation,
a concat, products and a sum) one ``com.microsoft.RotaryEmbedding``. The angles stay the
exporter's: the graph computes ``cos`` / ``sin`` [b, s, D] once from ``position_ids`` (with
whatever rope scaling the model has), and the op reads them as a table of ``b * s`` rows,
row ``i`` at position ``i``, as kvexport's own export does (``models/grouped_attention.py``),
so every row keeps its own positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase
from onnxscript.rewriter.pattern import Var as _Var

from ._masks import mask_lengths
from ._scores import AttentionTarget, Scores, attention_probs
from .values import const_ints, dims_of, take_graph_output
from .vocabulary import GQA_MARK, MS_DOMAIN

HEADS_FIRST = [0, 2, 1, 3]

Lengths = Callable[[], "tuple[ir.Value, ir.Value] | None"]


class FuseGroupedAttention(RewriteRuleClassBase):
    """The subgraph of the module docstring, with or without a past, with or without ``repeat_kv``."""

    def __init__(
        self, target: AttentionTarget, with_past: bool, repeated: bool, lengths: Lengths, fused: list[tuple[ir.Node, ir.Value, ir.Value]]
    ) -> None:
        name = f"{'Onnx' if target == 'onnx' else 'Ort'}GroupedAttention{'WithPast' if with_past else ''}{'' if repeated else 'SameHeads'}"
        super().__init__(name)
        self.target = target
        self.with_past = with_past
        self.repeated = repeated
        self.lengths = lengths
        # (fused op, the matched key, the matched value) of each prefill match, for take_over_presents
        self.fused = fused

    def pattern(
        self, op: Any, query: ir.Value, key: ir.Value, value: ir.Value, past_key: ir.Value, past_value: ir.Value
    ) -> tuple[ir.Value, ...]:
        """See the module docstring."""
        if self.with_past:
            present_key = op.Concat(past_key, key, axis=-2, _outputs=["present_key"])
            present_value = op.Concat(past_value, value, axis=-2, _outputs=["present_value"])
        else:
            present_key, present_value = key, value
        keys, values = present_key, present_value
        if self.repeated:
            keys = op.Reshape(
                op.Expand(op.Unsqueeze(present_key, _Var("key_axes")), _Var("key_expanded")),
                _Var("key_merged"),
                _allow_other_attributes=True,
            )
            values = op.Reshape(
                op.Expand(op.Unsqueeze(present_value, _Var("value_axes")), _Var("value_expanded")),
                _Var("value_merged"),
                _allow_other_attributes=True,
            )
        out = op.Transpose(op.MatMul(attention_probs(op, query, op.Transpose(keys, perm=[0, 1, 3, 2])), values), perm=HEADS_FIRST)
        return (out, present_key, present_value) if self.with_past else (out,)

    def check(
        self,
        context: Any,
        query: ir.Value,
        key: ir.Value,
        value: ir.Value,
        key_axes: ir.Value | None = None,
        value_axes: ir.Value | None = None,
        **bindings: Any,
    ) -> MatchResult:
        """Static heads that group evenly, a constant scale, 4-D masks, an attention_mask to read lengths from."""
        result = MatchResult()
        heads = _heads(query, key, value)
        if isinstance(heads, str):
            return result.fail(heads)
        if self.repeated and (const_ints(key_axes) != [2] or const_ints(value_axes) != [2]):
            return result.fail("the cache heads are not repeated along a new axis 2 (transformers' repeat_kv)")
        if not self.repeated and heads[0] != heads[1]:
            return result.fail("fewer cache heads than query heads, but the cache is not repeated")
        problem = Scores.of(bindings).problem(heads[0])
        if problem:
            return result.fail(problem)
        if self.target == "ort" and self.lengths() is None:
            return result.fail("the graph has no attention_mask input to read each row's length from")
        return result

    def rewrite(
        self,
        op: Any,
        query: ir.Value,
        key: ir.Value,
        value: ir.Value,
        past_key: ir.Value | None = None,
        past_value: ir.Value | None = None,
        **bindings: Any,
    ) -> tuple[ir.Value, ...]:
        """One fused op; its ``[b, s, H*D]`` output goes back to ``[b, s, H, D]``."""
        found = _heads(query, key, value)
        assert not isinstance(found, str)  # check() accepted this match
        heads, kv_heads, head_dim = found
        scores = Scores.of(bindings)
        scale, bias = scores.scale(), scores.bias(op)
        past = (past_key, past_value) if self.with_past else (None, None)
        q, k, v = (_tokens_first(op, x) for x in (query, key, value))
        if self.target == "onnx":
            output, present_key, present_value = op.Attention(
                q, k, v, bias, *past, q_num_heads=heads, kv_num_heads=kv_heads, scale=scale, _outputs=3
            )
        else:
            lengths = self.lengths()
            assert lengths is not None  # check() found them
            output, present_key, present_value = op.GroupQueryAttention(
                q, k, v, *past, *lengths, None, None, None, bias,
                num_heads=heads, kv_num_heads=kv_heads, scale=scale, _domain=MS_DOMAIN, _outputs=3,
            )  # fmt: skip
            fused = output.producer()
            fused.metadata_props[GQA_MARK] = "concat"
            if not self.with_past:
                self.fused.append((fused, key, value))
        output.type = query.type
        for present, source in ((present_key, key), (present_value, value)):
            present.type = source.type
        split_heads = op.Constant(value=ir.tensor(np.array([0, 0, heads, head_dim], np.int64)))
        out = op.Reshape(output, split_heads)
        return (out, present_key, present_value) if self.with_past else (out,)


class FuseRotary(RewriteRuleClassBase):
    """``x * cos4 + Concat(-x[..., D/2:], x[..., :D/2]) * sin4`` over ``[b, H, s, D]`` -> ``RotaryEmbedding``.

    ``cos4`` / ``sin4`` are ``Unsqueeze(cos, [1])`` of the ``[b, s, D]`` angles (shared by
    every layer, so outside the pattern). Where ``x`` is ``Transpose(Reshape(P, [.., H, D]))``
    of a ``[b, s, H*D]`` projection the op rotates ``P`` itself (the 3-D layout the attention
    rule then reads without a transpose); otherwise it rotates ``x`` in its 4-D layout.
    """

    def pattern(self, op: Any, x: ir.Value, cos4: ir.Value, sin4: ir.Value) -> ir.Value:
        """See the class docstring."""
        first = op.Slice(x, _Var("first_start"), _Var("first_end"), _Var("first_axis"), _allow_other_inputs=True, _outputs=["first"])
        second = op.Slice(x, _Var("second_start"), _Var("second_end"), _Var("second_axis"), _allow_other_inputs=True, _outputs=["second"])
        rotated = op.Concat(op.Neg(second), first, axis=-1)
        return op.Add(op.Mul(x, cos4), op.Mul(rotated, sin4))

    def check(self, context: Any, x: ir.Value, cos4: ir.Value, sin4: ir.Value, first: ir.Value, second: ir.Value, **_: Any) -> MatchResult:
        """Halves of a static head size, angles ``Unsqueeze([b, s, D], [1])``."""
        result = MatchResult()
        dims = dims_of(x)
        if dims is None or len(dims) != 4 or not isinstance(dims[3], int) or dims[3] % 2:
            return result.fail("the rotated tensor has no static even head size", x)
        half = dims[3] // 2
        for value, start, end in ((first, 0, half), (second, half, None)):
            node = value.producer()
            assert node is not None
            starts, ends, axes = (const_ints(v) for v in node.inputs[1:4])
            steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
            if starts != [start] or axes not in ([3], [-1]) or steps != [1] or ends is None or len(ends) != 1:
                return result.fail("not rotate_half's slices of the last axis", value)
            if (end is not None and ends[0] != end) or (end is None and ends[0] < dims[3]):
                return result.fail("not rotate_half's slices of the last axis", value)
        for angles in (cos4, sin4):
            if _angles(angles, dims[3]) is None:
                return result.fail("the angles are not Unsqueeze([batch, sequence, head size], [1])", angles)
        return result

    def rewrite(self, op: Any, x: ir.Value, cos4: ir.Value, sin4: ir.Value, **_: Any) -> ir.Value:
        """One op over the angles as a per-token table."""
        dims = dims_of(x)
        assert dims is not None and isinstance(dims[1], int) and isinstance(dims[3], int)
        heads, head_dim = dims[1], dims[3]
        cos, sin = _angles(cos4, head_dim), _angles(sin4, head_dim)
        assert cos is not None and sin is not None
        half = op.Constant(value=ir.tensor(np.array([head_dim // 2], np.int64)))
        zero, last = op.Constant(value=ir.tensor(np.array([0], np.int64))), op.Constant(value=ir.tensor(np.array([-1], np.int64)))
        rows = op.Constant(value=ir.tensor(np.array([-1, head_dim // 2], np.int64)))
        tables = [op.Reshape(op.Slice(angles, zero, half, last), rows) for angles in (cos, sin)]
        tokens = op.Shape(cos, start=0, end=2)
        count = op.ReduceProd(tokens, keepdims=0)
        positions = op.Reshape(op.Range(op.Constant(value=ir.tensor(np.array(0, np.int64))), count,
                                        op.Constant(value=ir.tensor(np.array(1, np.int64)))), tokens)  # fmt: skip
        projection = _split_projection(x, heads, head_dim)
        if projection is None:
            return op.RotaryEmbedding(x, positions, *tables, interleaved=0, _domain=MS_DOMAIN)
        rotated = op.RotaryEmbedding(projection, positions, *tables, interleaved=0, num_heads=heads, _domain=MS_DOMAIN)
        split_heads = op.Constant(value=ir.tensor(np.array([0, 0, heads, head_dim], np.int64)))
        return op.Transpose(op.Reshape(rotated, split_heads), perm=HEADS_FIRST)


def _angles(unsqueezed: ir.Value, head_dim: int) -> ir.Value | None:
    """The ``[b, s, D]`` angles under ``Unsqueeze(angles, [1])``, or None."""
    node = unsqueezed.producer()
    if node is None or node.op_type != "Unsqueeze" or const_ints(node.inputs[1]) != [1] or node.inputs[0] is None:
        return None
    dims = dims_of(node.inputs[0])
    return node.inputs[0] if dims is not None and len(dims) == 3 and dims[2] == head_dim else None


def _split_projection(x: ir.Value, heads: int, head_dim: int) -> ir.Value | None:
    """``P`` [b, s, H*D] where ``x`` is ``Transpose(Reshape(P, [.., .., H, D]), [0, 2, 1, 3])``, else None."""
    transpose = x.producer()
    if transpose is None or transpose.op_type != "Transpose" or list(transpose.attributes.get_ints("perm", [])) != HEADS_FIRST:
        return None
    reshape = transpose.inputs[0].producer() if transpose.inputs[0] is not None else None
    if reshape is None or reshape.op_type != "Reshape" or reshape.inputs[0] is None:
        return None
    target = const_ints(reshape.inputs[1])
    dims = dims_of(reshape.inputs[0])
    if target is None or len(target) != 4 or target[2:] != [heads, head_dim] or dims is None or len(dims) != 3 or dims[2] != heads * head_dim:
        return None
    return reshape.inputs[0]


def _heads(query: ir.Value, key: ir.Value, value: ir.Value) -> tuple[int, int, int] | str:
    """Query heads, cache heads and head size read off the matched tensors' static dims."""
    dims = [dims_of(x) for x in (query, key, value)]
    if any(d is None or len(d) != 4 or not all(isinstance(n, int) for n in (d[1], d[3])) for d in dims):
        return "query, key and value have no static [batch, heads, sequence, head size] shapes"
    (_, heads, _, head_dim), (_, kv_heads, _, key_dim), (_, value_heads, _, value_dim) = dims  # type: ignore[misc]
    if (key_dim, value_dim, value_heads) != (head_dim, head_dim, kv_heads):
        return "keys and values do not have the query's head size and one head count"
    heads, kv_heads, head_dim = int(heads), int(kv_heads), int(head_dim)
    if heads % kv_heads:
        return f"{heads} query heads do not group evenly over {kv_heads} cache heads"
    return heads, kv_heads, head_dim


def _tokens_first(op: Any, heads_first: ir.Value) -> ir.Value:
    """``[b, H, s, D]`` as ``[b, s, H*D]``: the Transpose's input reshaped where there is one."""
    producer = heads_first.producer()
    if producer is not None and producer.op_type == "Transpose" and list(producer.attributes.get_ints("perm", [])) == HEADS_FIRST:
        tokens = producer.inputs[0]
    else:
        tokens = op.Transpose(heads_first, perm=HEADS_FIRST)
    return op.Reshape(tokens, op.Constant(value=ir.tensor(np.array([0, 0, -1], np.int64))))


def take_over_presents(graph: ir.Graph, fused: list[tuple[ir.Node, ir.Value, ir.Value]]) -> int:
    """Prefill matches: the fused op's presents become the graph's present outputs the matched keys and values were.

    Returns how many outputs moved. The old values lose their output names and stay as
    the op's inputs (reshaped), so nothing else changes.
    """
    moved = 0
    for node, key, value in fused:
        for source, present in ((key, node.outputs[1]), (value, node.outputs[2])):
            if source.is_graph_output():
                take_graph_output(graph, source, present, source.shape)
                moved += 1
    return moved


def grouped_attention_rules(
    model: ir.Model, target: AttentionTarget
) -> tuple[list[Any], list[tuple[ir.Node, ir.Value, ir.Value]]]:
    """The rules for ``target`` (with and without past, repeated and same heads), and the list their prefill matches fill.

    The rules share one ``seqlens_k`` / ``total_sequence_length`` pair, made from
    ``attention_mask`` the first time a match needs it.
    """
    graph = model.graph
    made: list[tuple[ir.Value, ir.Value]] = []

    def lengths() -> tuple[ir.Value, ir.Value] | None:
        if not made:
            mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
            if mask is None:
                return None
            made.append(mask_lengths(graph, mask))
        return made[0]

    fused: list[tuple[ir.Node, ir.Value, ir.Value]] = []
    rules = []
    for with_past in (True, False):
        for repeated in (True, False):
            rules.append(FuseGroupedAttention.rule(target, with_past, repeated, lengths, fused))
    return rules, fused
