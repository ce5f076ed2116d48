"""transposed_weight_gemm: fold a constant-weight Transpose into Gemm's ``transB``.

A tied LM head exports as ``MatMul(X, Transpose(W))`` with ``W`` the [V, E] embedding.
ONNX Runtime constant-folds that Transpose into a second, private copy of the largest
weight in the model (154 MB for GPT-2 124M) in every session. ``Gemm`` reads ``W`` as
it is stored::

    MatMul(X[M, E], Transpose(W[V, E], perm=[1, 0]))  ->  Gemm(X, W, transB=1)

Only rank-2 ``X`` and a constant 2-D ``W`` match; anything else is left alone.

Exporters that fold that Transpose themselves (Optimum, the TorchScript exporter) store
the copy in the file: ``MatMul(X, WT)`` with ``WT`` an initializer equal to the
transpose of another one, ``W``. ``TiedTransposedCopyToGemm`` reads ``W`` instead, so the
copy goes; a 3-D ``X`` is flattened around the Gemm::

    MatMul(X[b, s, E], WT[E, V])  ->  Reshape(Gemm(Reshape(X, [-1, E]), W, transB=1), [b, s, V])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult
from onnxscript.rewriter import MatchResult, RewriteRule

from ._rules import RulePass
from .values import ints


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


def _transposed_twin(graph: ir.Graph, weight: ir.Value) -> ir.Value | None:
    """Another initializer whose transpose equals ``weight`` exactly, or None."""
    if weight.const_value is None or weight.shape is None or len(weight.shape) != 2:
        return None
    rows, columns = weight.shape
    array: np.ndarray | None = None
    for other in graph.initializers.values():
        if other is weight or other.const_value is None or other.shape is None:
            continue
        if list(other.shape) != [columns, rows] or other.const_value.dtype != weight.const_value.dtype:
            continue
        array = weight.const_value.numpy() if array is None else array
        candidate = other.const_value.numpy()
        # one row against one column first: every layer's same-shaped projections are candidates,
        # and a whole strided comparison of each pair took minutes on a 30-layer model
        if np.array_equal(candidate[0], array[:, 0]) and np.array_equal(candidate.T, array):
            return other
    return None


def tie_transposed_copies(model: ir.Model) -> int:
    """``TiedTransposedCopyToGemm`` (see the module docstring); returns how many MatMuls changed."""
    graph = model.graph
    changed = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.inputs[1] is None:
            continue
        x, copy = node.inputs[0], node.inputs[1]
        twin = _transposed_twin(graph, copy)
        if x is None or twin is None:
            continue
        assert copy.shape is not None
        features, vocab = int(copy.shape[0]), int(copy.shape[1])  # type: ignore[arg-type]
        if x.shape is not None and len(x.shape) == 2:
            gemm = ir.node("Gemm", [x, twin], attributes={"transB": 1})
            new_nodes, result = [gemm], gemm.outputs[0]
        else:
            flat = ir.node("Reshape", [x, ints(graph, [-1, features])])
            gemm = ir.node("Gemm", [flat.outputs[0], twin], attributes={"transB": 1})
            lead = ir.node("Shape", [x], attributes={"start": 0, "end": -1})
            target = ir.node("Concat", [lead.outputs[0], ints(graph, [vocab])], attributes={"axis": 0})
            back = ir.node("Reshape", [gemm.outputs[0], target.outputs[0]])
            new_nodes, result = [flat, gemm, lead, target, back], back.outputs[0]
        graph.insert_before(node, new_nodes)
        output = node.outputs[0]
        result.shape, result.type = output.shape, output.type
        if output.is_graph_output():
            index = list(graph.outputs).index(output)
            name = output.name
            output.name = f"{name}.untied"
            result.name = name
            graph.outputs[index] = result
        else:
            output.replace_all_uses_with(result)
        graph.remove(node, safe=True)
        changed += 1
    return changed


class TransposedWeightGemmPass(RulePass):
    """Rewrite ``MatMul(X, Transpose(W))`` (and ``MatMul(X, WT)`` with ``WT`` a stored transpose of ``W``) into ``Gemm(X, W, transB=1)``; ``counts`` says how often."""

    rules = (RULE,)

    def call(self, model: ir.Model) -> PassResult:
        """The rule, then the stored transposed copies."""
        result = super().call(model)
        self.counts["TiedTransposedCopyToGemm"] = tie_transposed_copies(model)
        return PassResult(model, modified=result.modified or bool(self.counts["TiedTransposedCopyToGemm"]))
