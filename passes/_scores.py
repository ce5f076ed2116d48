"""The scores of an attention subgraph as the fusion rules match them: scale, masks, NaN guard.

:mod:`.fuse_attention` (multi-head) and :mod:`.fuse_grouped_attention` (grouped-query) match
the same part from the query and the transposed keys to the softmax; it is written once here.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter.pattern import OrValue
from onnxscript.rewriter.pattern import Var as _Var

from ._masks import is_lowest
from .values import const_float, dims_of

AttentionTarget = Literal["onnx", "ort"]


def attention_probs(op: Any, q: Any, key_t: Any) -> Any:
    """The pattern from the query and the transposed keys to the softmax: scale, masks, NaN guard.

    Each choice is between different op types, so onnxscript dispatches on the op it finds
    instead of backtracking (it does not undo a failed alternative's bindings when two
    alternatives share pattern nodes). Its variables are :class:`Scores`' fields.
    """
    product = op.MatMul(
        OrValue([op.Mul(q, _Var("query_scale")), q]), OrValue([op.Mul(key_t, _Var("key_scale")), key_t])
    )
    scaled = [op.Div(product, _Var("divisor")), op.Mul(product, _Var("scale_after")), product]
    causal = [op.Where(_Var("causal"), OrValue(scaled), _Var("causal_fill")), *scaled]
    scores = OrValue([op.Add(OrValue(causal), _Var("mask_bias")), *causal])
    probs = op.Softmax(scores, axis=-1)
    return OrValue([op.Where(op.IsNaN(probs), _Var("zero"), probs), probs])


class Scores(NamedTuple):
    """The variables :func:`attention_probs` binds (None where the match took another alternative)."""

    query_scale: ir.Value | None = None
    key_scale: ir.Value | None = None
    divisor: ir.Value | None = None
    scale_after: ir.Value | None = None
    causal: ir.Value | None = None
    causal_fill: ir.Value | None = None
    mask_bias: ir.Value | None = None
    zero: ir.Value | None = None

    @classmethod
    def of(cls, bindings: dict[str, Any]) -> Scores:
        """The scores' part of a rule's bindings."""
        return cls(*(bindings.get(name) for name in cls._fields))

    def problem(self, heads: int) -> str:
        """Why the match can't be fused (empty if it can): scale, NaN guard, fills, mask shapes."""
        if self.scale() is None:
            return "the attention scale is not a scalar constant"
        if self.zero is not None and const_float(self.zero) != 0.0:
            return "NaNs are not replaced by 0"
        if self.causal is not None and not is_lowest(self.causal_fill):
            return "the causal Where does not fill with -inf or the lowest float"
        for bias in (self.causal, self.mask_bias):
            if bias is None:
                continue
            bias_dims = dims_of(bias)
            if bias.shape is None or len(bias.shape) != 4:
                return "a mask is not 4-D"
            if bias_dims is not None and bias_dims[1] not in (1, heads):
                return "a mask has a head dim that is neither 1 nor the heads"
        return ""

    def bias(self, op: Any) -> ir.Value | None:
        """One additive bias for the fused op: the causal Where's bias plus the mask's.

        ``Where(c, s, fill) + m`` equals ``s + (Where(c, 0, fill) + m)`` wherever ``c``
        holds, and where it does not both are ``fill + m`` (``s`` vanishes next to the
        lowest float), so the fused op sees the same scores.
        """
        if self.causal is None:
            return self.mask_bias
        assert self.causal_fill is not None and self.causal_fill.const_value is not None
        zero = np.zeros((), dtype=self.causal_fill.const_value.numpy().dtype)
        causal_bias = op.Where(self.causal, op.Constant(value=ir.tensor(zero)), self.causal_fill)
        return causal_bias if self.mask_bias is None else op.Add(causal_bias, self.mask_bias)

    def scale(self) -> float | None:
        """The softmax scale of whichever scaling the pattern matched; None if not a constant.

        SDPA scales query and key by ``c`` each (``c * c``); eager attention divides (or
        multiplies) the scores after the MatMul; some exporters scale only one operand.
        Each factor that is absent is 1.
        """
        scale = 1.0
        for factor in (self.query_scale, self.key_scale, self.scale_after):
            if factor is not None:
                found = const_float(factor)
                if found is None:
                    return None
                scale *= found
        if self.divisor is not None:
            found = const_float(self.divisor)
            if not found:
                return None
            scale /= found
        return scale
