"""transposed_weight_gemm: fold a constant-weight Transpose into Gemm's ``transB``.

A tied LM head exports as ``MatMul(X, Transpose(W))`` with ``W`` the [V, E] embedding.
ONNX Runtime constant-folds that Transpose into a second, private copy of the largest
weight in the model (154 MB for GPT-2 124M) in every session. ``Gemm`` reads ``W`` as
it is stored::

    MatMul(X[M, E], Transpose(W[V, E], perm=[1, 0]))  ->  Gemm(X, W, transB=1)

Only rank-2 ``X`` and a constant 2-D ``W`` match; anything else is left alone.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule

from passes._rules import RulePass


def _pattern(op: Any, x: ir.Value, weight: ir.Value) -> ir.Value:
    return op.MatMul(x, op.Transpose(weight, perm=[1, 0]))


def _check(context: Any, x: ir.Value, weight: ir.Value, **_: Any) -> MatchResult:
    result = MatchResult()
    if weight.const_value is None:
        return result.fail("the transposed operand is not a constant weight", weight)
    if weight.shape is None or len(weight.shape) != 2:
        return result.fail("the weight is not 2-D", weight)
    if x.shape is None or len(x.shape) != 2:
        return result.fail("the activation is not known to be 2-D", x)
    return result


def _rewrite(op: Any, x: ir.Value, weight: ir.Value, **_: Any) -> ir.Value:
    return op.Gemm(x, weight, transB=1)


RULE = RewriteRule(_pattern, _rewrite, _check, name="MatMulTransposedWeightToGemm")


class TransposedWeightGemmPass(RulePass):
    """Rewrite ``MatMul(X, Transpose(W))`` into ``Gemm(X, W, transB=1)``; ``counts`` says how often."""

    rules = (RULE,)
