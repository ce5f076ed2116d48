"""fuse_ort_block: ONNX Runtime's fused ops for the rest of a block (GPT-2's, and the Llama-style RMSNorm).

Run with ``fuse_attention(target="ort")`` to bring a decode layer to ~10 nodes:

- ``FastGelu``: GPT-2's tanh-approximated gelu, eight nodes::

      Mul(Mul(x, 0.5), Add(Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)), 0.7978845608)), 1))

  becomes ``com.microsoft.FastGelu(x)``, which computes exactly that formula. When ``x``
  is ``Add(h, b)`` with a constant 1-D ``b`` (the c_fc bias), the bias moves into FastGelu.
- ``SkipLayerNormalization``: ``LayerNormalization(Add(a, b), gamma, beta)`` becomes
  ``com.microsoft.SkipLayerNormalization(a, b, gamma, beta)``; its fourth output is the
  sum, so the residual stream that also reads ``Add(a, b)`` keeps working. A constant
  1-D bias added to ``a`` or ``b`` just before moves into the op's bias input. Not for a
  CPU graph (``skip_layer_norm=False``): ONNX Runtime 1.31's CPU kernel of this op took
  3-8x as long as ``Add`` + ``LayerNormalization`` at 16 to 2048 rows of 768 (2 cores with
  AVX-512), where the RMSNorm pair's fused kernel is as fast as the two ops.
- ``SimplifiedLayerNormalization`` / ``SkipSimplifiedLayerNormalization``: the Llama-style
  RMSNorm, ``x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2)) + eps)) * weight`` (and that of a
  residual sum), by onnxscript's own ``ort_fusions`` rules; ``Div(1, s)`` (TorchScript's
  ``rsqrt``, in Optimum's graphs) is read as ``Reciprocal(s)`` first; opset 23's
  ``RMSNormalization`` becomes the contrib op too.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnx_ir.passes import PassResult
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase
from onnxscript.rewriter.ort_fusions.rms_normalization import rms_normalization_rules
from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

from ._rules import RulePass
from .values import const_close, const_float
from .vocabulary import MS_DOMAIN

_GELU_CONSTANTS = {"half": 0.5, "cube": 3.0, "coefficient": 0.044715, "sqrt_2_over_pi": 0.7978845608, "one": 1.0}


def _bias_source(value: ir.Value, allowed_uses: int) -> tuple[ir.Value, ir.Value] | None:
    """``(h, b)`` when ``value`` is ``Add(h, b)`` with a constant 1-D ``b`` and no other users."""
    node = value.producer()
    if node is None or node.op_type != "Add" or node.domain not in ("", "ai.onnx"):
        return None
    if len(value.uses()) != allowed_uses or value.is_graph_output():
        return None
    for data, bias in (node.inputs, reversed(node.inputs)):
        if bias is not None and data is not None and bias.const_value is not None and bias.shape is not None and len(bias.shape) == 1:
            return data, bias
    return None


class FastGeluRule(RewriteRuleClassBase):
    """The tanh gelu -> ``FastGelu``."""

    def pattern(self, op: Any, x: ir.Value, half: ir.Value, cube: ir.Value, coefficient: ir.Value, sqrt_2_over_pi: ir.Value, one: ir.Value) -> ir.Value:
        """See the module docstring."""
        inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, cube), coefficient)), sqrt_2_over_pi)
        return op.Mul(op.Mul(x, half), op.Add(op.Tanh(inner), one))

    def check(self, context: Any, x: ir.Value, **constants: Any) -> MatchResult:
        """The constants are gelu's (to the precision of their own type: fp32 or fp16)."""
        result = MatchResult()
        for name, expected in _GELU_CONSTANTS.items():
            if const_close(constants[name], expected) is None:
                return result.fail(f"{name} is {const_float(constants[name])}, not {expected}")
        return result

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> ir.Value:
        """FastGelu, with the bias folded in when ``x`` is ``Add(h, b)`` (x's three uses are the gelu's)."""
        source = _bias_source(x, allowed_uses=3)
        if source is not None:
            data, bias = source
            return op.FastGelu(data, bias, _domain=MS_DOMAIN)
        return op.FastGelu(x, _domain=MS_DOMAIN)


class SkipLayerNormRule(RewriteRuleClassBase):
    """``LayerNormalization(Add(a, b))`` -> ``SkipLayerNormalization(a, b)`` (plus the sum)."""

    def pattern(self, op: Any, a: ir.Value, b: ir.Value, gamma: ir.Value, beta: ir.Value) -> tuple[ir.Value, ir.Value]:
        """A residual add followed by a LayerNorm."""
        total = op.Add(a, b, _outputs=["total"])
        return op.LayerNormalization(total, gamma, beta, _allow_other_attributes=True, _outputs=["normed"]), total

    def check(self, context: Any, a: ir.Value, b: ir.Value, gamma: ir.Value, normed: ir.Value, total: ir.Value, **_: Any) -> MatchResult:
        """Normalised over the last axis of a 3-D sum of two 3-D addends; gamma is 1-D."""
        result = MatchResult()
        node = normed.producer()
        assert node is not None
        rank = len(total.shape) if total.shape is not None else None
        axis = node.attributes.get_int("axis", -1)
        if rank != 3 or axis not in (-1, 2):
            return result.fail("not a LayerNorm over the last axis of a 3-D tensor")
        if a.shape is None or b.shape is None or len(a.shape) != 3 or len(b.shape) != 3:
            return result.fail("the addends are not both 3-D")
        if gamma.shape is None or len(gamma.shape) != 1:
            return result.fail("gamma is not 1-D")
        return result

    def rewrite(
        self, op: Any, a: ir.Value, b: ir.Value, gamma: ir.Value, beta: ir.Value, normed: ir.Value, **_: Any
    ) -> tuple[ir.Value, ir.Value]:
        """SkipLayerNormalization; output 0 is the norm, output 3 the sum.

        A constant 1-D bias added to one addend just before (its only use) moves into the
        op's bias input.
        """
        node = normed.producer()
        assert node is not None
        inputs = [a, b, gamma, beta]
        for data, other in ((a, b), (b, a)):
            source = _bias_source(data, allowed_uses=1)
            if source is not None:
                inputs = [source[0], other, gamma, beta, source[1]]
                break
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        norm, _mean, _inv_std, total = op.SkipLayerNormalization(
            *inputs, epsilon=epsilon, _domain=MS_DOMAIN, _outputs=4
        )
        return norm, total


class OneOverToReciprocal(RewriteRuleClassBase):
    """``Div(1, x)`` -> ``Reciprocal(x)``: TorchScript traces ``torch.rsqrt`` so (Optimum's RMSNorm); onnxscript's rule reads Reciprocal."""

    def pattern(self, op: Any, one: ir.Value, x: ir.Value) -> ir.Value:
        """One over a value."""
        return op.Div(one, x)

    def check(self, context: Any, one: ir.Value, **_: Any) -> MatchResult:
        """The numerator is the constant 1."""
        return MatchResult() if const_float(one) == 1.0 else MatchResult().fail("the numerator is not the constant 1", one)

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> ir.Value:
        """The same number, as onnxscript's RMSNorm rule spells it."""
        return op.Reciprocal(x)


class StandardRmsNormToOrt(RewriteRuleClassBase):
    """Opset 23's ``RMSNormalization`` over the last axis -> ONNX Runtime's ``SimplifiedLayerNormalization``.

    The same formula; ONNX Runtime's kernel is the fused one, and the skip rule then folds
    the residual Add before it in.
    """

    def pattern(self, op: Any, x: ir.Value, scale: ir.Value) -> ir.Value:
        """The standard op."""
        return op.RMSNormalization(x, scale, _allow_other_attributes=True, _outputs=["normed"])

    def check(self, context: Any, normed: ir.Value, **_: Any) -> MatchResult:
        """Normalizes over the last axis only, in float32 (what the contrib op's stash type computes in)."""
        node = normed.producer()
        assert node is not None
        if node.attributes.get_int("axis", -1) != -1 or node.attributes.get_int("stash_type", 1) != 1:
            return MatchResult().fail("not over the last axis alone, or not computed in float32")
        return MatchResult()

    def rewrite(self, op: Any, x: ir.Value, scale: ir.Value, normed: ir.Value, **_: Any) -> ir.Value:
        """The contrib op with the same epsilon."""
        node = normed.producer()
        assert node is not None
        epsilon = node.attributes.get_float("epsilon", 1e-5)
        return op.SimplifiedLayerNormalization(x, scale, axis=-1, epsilon=epsilon, stash_type=1)


class FuseOrtBlockPass(RulePass):
    """FastGelu, SkipLayerNormalization and the RMSNorm pair (ONNX Runtime contrib ops); ``counts`` per rule.

    Args:
        explain: record why each rule that fired 0 times missed (see :class:`RulePass`).
        skip_layer_norm: fuse a residual ``Add`` into ``SkipLayerNormalization``; False for
            a graph that runs on CPU, where that op is the slower one (see the module docstring).

    """

    def __init__(self, explain: bool = False, *, skip_layer_norm: bool = True) -> None:
        super().__init__(explain)
        skip = (SkipLayerNormRule.rule(),) if skip_layer_norm else ()
        self.rules = (FastGeluRule.rule(), *skip, OneOverToReciprocal.rule(), *rms_normalization_rules, StandardRmsNormToOrt.rule())

    def call(self, model: ir.Model) -> PassResult:
        """Fuse in place; adds the ``com.microsoft`` opset import."""
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        for node in model.graph:  # onnxscript's RMSNorm rule reads this attribute; TorchScript leaves the default out
            if node.op_type == "ReduceMean" and node.domain in ("", "ai.onnx") and "noop_with_empty_axes" not in node.attributes:
                node.attributes["noop_with_empty_axes"] = ir.AttrInt64("noop_with_empty_axes", 0)
        result = super().call(model)
        self.counts["SkipSimplifiedLayerNormalization"] = fuse_skip_rms_normalization(model)
        return PassResult(model, modified=result.modified or bool(self.counts["SkipSimplifiedLayerNormalization"]))
