"""fuse_attention: one attention op per layer, keeping the past/present contract.

Both torch exporters lower GPT-2's ``scaled_dot_product_attention`` (after fold_shapes)
to the same subgraph; with a cache it reads::

    q = Transpose(Reshape(Q[b,s,E], [0,0,H,D]), [0,2,1,3])           (k, v alike)
    present_key = Concat(past_key, k, axis=-2)                        (value alike)
    scores = MatMul(Mul(q, c), Mul(Transpose(present_key, [0,1,3,2]), c)) + mask_bias
    probs = Where(IsNaN(Softmax(scores)), 0, Softmax(scores))
    out = Transpose(MatMul(probs, present_value), [0,2,1,3])          # [b,s,H,D]

and without a cache (prefill) the Concats are absent. The rule replaces it by

- ``target="onnx"``: ``Attention(Q, K, V, mask_bias, past_key, past_value)``, the
  standard opset-23 op (the model is converted to opset 23 first);
- ``target="ort"``: ONNX Runtime's ``com.microsoft.MultiHeadAttention`` with
  ``attention_bias`` and ``past_key`` / ``past_value``,

with ``scale = c * c``, 3-D Q/K/V, and the present tensors as the op's outputs. The
``[b,s,E]`` result is reshaped to ``[b,s,H,D]`` where the old output was; fold_shapes'
rules then cancel that reshape against the one that follows.

A mask bias written as ``Where(mask, 0, -inf)`` is changed to use the lowest finite
float first: a fully masked row (a left-padding position) must not produce NaN in a
fused kernel that, unlike the decomposition, has no ``IsNaN`` guard. Real positions
never attend to such rows, so outputs that matter don't change.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import TopologicalSortPass
from onnxscript import version_converter
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleClassBase

from ._rules import apply_rules
from ._scores import AttentionTarget, Scores, attention_probs
from .fuse_grouped_attention import FuseRotary, grouped_attention_rules, take_over_presents
from .values import const_float, const_ints, dims_of
from .vocabulary import FUSED_ATTENTION, MS_DOMAIN

ONNX_ATTENTION_OPSET = 23


class InfiniteMaskToLowest(RewriteRuleClassBase):
    """``Where(mask, 0, -inf)`` -> ``Where(mask, 0, lowest)`` (see the module docstring)."""

    def pattern(self, op: Any, condition: ir.Value, zero: ir.Value, fill: ir.Value) -> ir.Value:
        """A boolean mask turned into an additive bias."""
        return op.Where(condition, zero, fill)

    def check(self, context: Any, zero: ir.Value, fill: ir.Value, **_: Any) -> MatchResult:
        """The fill is -inf and the kept value is 0."""
        result = MatchResult()
        if const_float(zero) != 0.0 or const_float(fill) != -np.inf:
            return result.fail("not a Where(mask, 0, -inf) bias")
        for use in context.output_values[0].uses():
            adds = use.node.outputs[0].uses() if use.node.op_type == "Add" else []
            if not adds or any(u.node.op_type != "Softmax" for u in adds):
                return result.fail("the bias does not only feed Add -> Softmax")
        return result

    def rewrite(self, op: Any, condition: ir.Value, zero: ir.Value, fill: ir.Value, **_: Any) -> ir.Value:
        """Same mask, finite fill (the lowest number of the fill's own dtype)."""
        assert fill.const_value is not None  # check() read it as -inf
        dtype = fill.const_value.numpy().dtype
        lowest = np.array(np.finfo(dtype).min, dtype=dtype)
        return op.Where(condition, zero, op.Constant(value=ir.tensor(lowest)))


class _FuseAttention(RewriteRuleClassBase):
    """The attention subgraph of the module docstring, with or without a cache."""

    def __init__(self, target: AttentionTarget, with_past: bool) -> None:
        name = f"{'Onnx' if target == 'onnx' else 'Ort'}Attention{'WithPast' if with_past else ''}"
        super().__init__(name)
        self.target = target
        self.with_past = with_past

    def pattern(
        self,
        op: Any,
        query: ir.Value,
        key: ir.Value,
        value: ir.Value,
        query_shape: ir.Value,
        key_shape: ir.Value,
        value_shape: ir.Value,
        past_key: ir.Value,
        past_value: ir.Value,
    ) -> tuple[ir.Value, ir.Value, ir.Value]:
        """See the module docstring: the SDPA form, and the eager form's alternatives."""
        heads_first = [0, 2, 1, 3]
        q = op.Transpose(op.Reshape(query, query_shape, _allow_other_attributes=True), perm=heads_first)
        k = op.Transpose(op.Reshape(key, key_shape, _allow_other_attributes=True), perm=heads_first)
        v = op.Transpose(op.Reshape(value, value_shape, _allow_other_attributes=True), perm=heads_first)
        if self.with_past:
            present_key = op.Concat(past_key, k, axis=-2, _outputs=["present_key"])
            present_value = op.Concat(past_value, v, axis=-2, _outputs=["present_value"])
        else:
            present_key, present_value = k, v
        out = op.MatMul(attention_probs(op, q, op.Transpose(present_key, perm=[0, 1, 3, 2])), present_value)
        return op.Transpose(out, perm=heads_first), present_key, present_value

    def check(
        self, context: Any, query: ir.Value, query_shape: ir.Value, key_shape: ir.Value, value_shape: ir.Value, **bindings: Any
    ) -> MatchResult:
        """Heads and head dim are constants, the scale is a scalar, the masks are 4-D."""
        numbers = _attention_numbers(query, query_shape, key_shape, value_shape, Scores.of(bindings))
        return MatchResult().fail(numbers) if isinstance(numbers, str) else MatchResult()

    def rewrite(
        self,
        op: Any,
        query: ir.Value,
        key: ir.Value,
        value: ir.Value,
        query_shape: ir.Value,
        key_shape: ir.Value,
        value_shape: ir.Value,
        past_key: ir.Value | None = None,
        past_value: ir.Value | None = None,
        **bindings: Any,
    ) -> tuple[ir.Value, ir.Value, ir.Value]:
        """One fused op; its 3-D output goes back to [b, s, H, D] where the old output was."""
        scores = Scores.of(bindings)
        numbers = _attention_numbers(query, query_shape, key_shape, value_shape, scores)
        assert not isinstance(numbers, str)  # check() accepted this match
        past = (past_key, past_value) if self.with_past else (None, None)
        mask_bias = scores.bias(op)
        if self.target == "onnx":
            output, present_key, present_value = op.Attention(
                query,
                key,
                value,
                mask_bias,
                *past,
                q_num_heads=numbers.heads,
                kv_num_heads=numbers.heads,
                scale=numbers.scale,
                _outputs=3,
            )
        else:
            output, present_key, present_value = op.MultiHeadAttention(
                query,
                key,
                value,
                None,  # bias
                None,  # key_padding_mask
                mask_bias,
                *past,
                num_heads=numbers.heads,
                scale=numbers.scale,
                _domain=MS_DOMAIN,
                _outputs=3,
            )
        # The fused ops' outputs have the query's shape and type; say so, so that the
        # shape rules that run next need no inference through a contrib or opset-23 op.
        output.shape, output.type = query.shape, query.type
        split_heads = op.Constant(value=ir.tensor([0, 0, numbers.heads, numbers.head_dim], dtype=ir.DataType.INT64))
        return op.Reshape(output, split_heads), present_key, present_value


class _AttentionNumbers(NamedTuple):
    """What the fused op needs to know of a matched attention: heads, head size, scale."""

    heads: int
    head_dim: int
    scale: float


def _attention_numbers(
    query: ir.Value, query_shape: ir.Value, key_shape: ir.Value, value_shape: ir.Value, scores: Scores
) -> _AttentionNumbers | str:
    """Heads, head size and scale read off a match, or why they can't be (for ``check``)."""
    shapes = [const_ints(s) for s in (query_shape, key_shape, value_shape)]
    if any(s is None or len(s) != 4 for s in shapes):
        return "the split into heads is not a constant rank-4 Reshape"
    heads, head_dim = shapes[0][2], shapes[0][3]  # type: ignore[index]
    if heads <= 0 or head_dim <= 0 or any(s[2:] != [heads, head_dim] for s in shapes):  # type: ignore[index]
        return "query, key and value are not split into the same heads"
    query_dims = dims_of(query)
    if query_dims is None or len(query_dims) != 3 or query_dims[2] != heads * head_dim:
        return "the query is not a [batch, sequence, heads * head_dim] tensor"
    problem = scores.problem(heads)
    if problem:
        return problem
    scale = scores.scale()
    assert scale is not None  # problem() checked it
    return _AttentionNumbers(heads, head_dim, scale)


def attention_rules(target: AttentionTarget) -> list[RewriteRule]:
    """The fusion rules for ``target``: with a cache (decode) and without (prefill)."""
    return [_FuseAttention.rule(target, True), _FuseAttention.rule(target, False)]


def count_attention_ops(model: ir.Model) -> int:
    """Fused attention nodes (ONNX ``Attention`` and ORT's attention ops) in the main graph."""
    return sum(1 for node in model.graph if node.op_type in FUSED_ATTENTION)


class FuseAttentionPass(InPlacePass):
    """Fuse each layer's attention into one op for ``target``; ``counts`` per rule.

    ``target="onnx"`` converts the model to opset 23 first (the ``Attention`` op's
    opset). Subgraphs that don't match are left as they are; ``counts`` and the
    remaining ``Softmax`` nodes show what was not fused, and with ``explain``,
    ``explanations`` says why each fusion rule that fired 0 times did not match.
    """

    def __init__(self, target: AttentionTarget, explain: bool = False) -> None:
        super().__init__()
        self.target: AttentionTarget = target
        self.counts: dict[str, int] = {}
        self.explain = explain
        self.explanations: dict[str, str] = {}

    def call(self, model: ir.Model) -> PassResult:
        """Fuse in place."""
        if self.target == "onnx" and model.opset_imports.get("", 0) < ONNX_ATTENTION_OPSET:
            version_converter.convert_version(model, ONNX_ATTENTION_OPSET)
        if self.target == "ort":
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        self.explanations = {}
        explanations = self.explanations if self.explain else None
        self.counts = apply_rules(model, [InfiniteMaskToLowest.rule()])
        self.counts.update(apply_rules(model, attention_rules(self.target), explanations))
        if any(node.op_type == "Softmax" for node in model.graph):  # what the multi-head rules left: grouped-query attention
            if self.target == "ort":
                self.counts.update(apply_rules(model, [FuseRotary.rule()], explanations))
            rules, fused = grouped_attention_rules(model, self.target)
            self.counts.update(apply_rules(model, rules, explanations))
            self.counts["presents_taken_over"] = take_over_presents(model.graph, fused)
            if any(self.counts.values()):
                TopologicalSortPass()(model)  # the length nodes were appended; put them before their users
        return PassResult(model, modified=any(self.counts.values()))


def unfused_attention(model: ir.Model, target: AttentionTarget) -> str:
    """Why ``model`` still has attention that ``target``'s rules did not fuse; empty if none is left.

    Attention left is a ``Softmax`` that survived the fusion. The answer names how many
    and the rule that came closest to one of them, with its :func:`explain_miss` (the rule
    that matched the most nodes). Matching under the tracer may add ``attention_mask``'s
    length nodes to the graph; call it on a graph that is refused anyway.
    """
    from ._rules import closest_miss

    left = sum(1 for node in model.graph if node.op_type == "Softmax")
    if not left:
        return ""
    best, best_nodes = "", -1
    for rule in [*attention_rules(target), *grouped_attention_rules(model, target)[0]]:
        nodes, why = closest_miss(model, rule)
        if nodes > best_nodes:
            best, best_nodes = f"{rule.name}: {why}", nodes
    return f"{left} attention subgraph(s) left unfused (closest rule {best})"
