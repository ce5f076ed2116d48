"""pack_projections: one MatMul for an attention's query, key and value, as CUDA graphs want.

A Llama-style export computes each attention's query, key and value with three
``MatMul`` ops over the same normalized hidden state, each followed by what its family does
to it (a bias ``Add``, Qwen3's per-head RMSNorm, ``RotaryEmbedding`` for the query and
key) before ``GroupQueryAttention``. ONNX Runtime's CUDA provider runs an extended-level
graph transformer, ``GroupQueryAttentionFusion``, on exactly that shape when the rotary
ops read the ``MatMul`` ops directly: it merges the three weights, moves the rotation into
the attention op (``do_rotary``, with the rotary op's cos/sin inputs as position-indexed
caches) and rewires the node's first nine inputs. On kvexport's graphs it is wrong twice
over: the node's eleventh input (the padding bias) is left counted, so the session fails
to load ("The sum of input arg count is not equal to size of input defs"), and kvexport's
rotary tables are indexed by token (each row's own positions: left-padded batches, slots),
not by position. Measured on an H200 with ONNX Runtime 1.31.1: every Llama-family
``ort-cuda`` export failed to load at ``graph_optimization_level`` EXTENDED and ALL and
loaded at BASIC.

This pass gives each such attention one ``MatMul`` over the concatenated weights and a
``Split`` into the three projections; whatever followed each projection stays as it was::

    MatMul(x, Wq) ... -> q      MatMul(x, concat(Wq, Wk, Wv)) -> Split -> q_part ... -> q
    MatMul(x, Wk) ... -> k  =>                                  -> k_part ... -> k
    MatMul(x, Wv) ... -> v                                      -> v_part ... -> v

The numbers are the same (each output column is the same dot product), the fusion no
longer matches (the rotary ops read a ``Split``), and a decode step runs one GEMM where it
ran three, the packing the fusion itself was after. Weight quantization runs after this
pass, so ``MatMulNBits`` quantizes the packed weight column by column as it would have
quantized each. Attentions whose projections already share one ``MatMul`` (Phi-3's
``qkv_proj``, GPT-2's ``c_attn``), whose weights are not constant 2-D initializers of one
type, or whose projections read different inputs are left alone. ``counts["packed"]``
says how many attentions were packed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .values import initializer, ints
from .vocabulary import GROUP_QUERY_ATTENTION, MS_DOMAIN

# how many ops back from the attention's input a projection's MatMul may be (rotary, a bias
# Add, Qwen3's Reshape -> SimplifiedLayerNormalization -> Reshape)
_DEPTH = 6


def _projection(value: ir.Value | None) -> ir.Node | None:
    """The ``MatMul`` that ``value`` derives from through first inputs, at most ``_DEPTH`` ops back."""
    for _ in range(_DEPTH):
        node = value.producer() if value is not None else None
        if node is None:
            return None
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
            return node
        value = node.inputs[0] if node.inputs else None
    return None


def _weight(node: ir.Node) -> np.ndarray | None:
    weight = node.inputs[1]
    if weight is None or weight.const_value is None:
        return None
    array = weight.const_value.numpy()
    return array if array.ndim == 2 else None


class PackProjectionsPass(InPlacePass):
    """Each GroupQueryAttention's three projection ``MatMul`` ops as one ``MatMul`` and a ``Split``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {"packed": 0}

    def call(self, model: ir.Model) -> PassResult:
        """Pack every attention whose projections qualify (see the module docstring)."""
        graph = model.graph
        self.counts["packed"] = 0
        for node in list(graph):
            if node.op_type != GROUP_QUERY_ATTENTION or node.domain != MS_DOMAIN or len(node.inputs) < 3:
                continue
            projections = [_projection(node.inputs[i]) for i in range(3)]
            if any(p is None for p in projections) or len({id(p) for p in projections}) != 3:
                continue
            matmuls: list[ir.Node] = [p for p in projections if p is not None]
            source = matmuls[0].inputs[0]
            weights = [_weight(m) for m in matmuls]
            if source is None or any(m.inputs[0] is not source for m in matmuls):
                continue
            arrays = [w for w in weights if w is not None]
            if len(arrays) != 3 or len({(a.shape[0], a.dtype) for a in arrays}) != 1:
                continue
            if any(len(list(m.inputs[1].uses())) != 1 for m in matmuls if m.inputs[1] is not None):
                continue  # a weight something else reads too stays where it is
            self._pack(graph, node, matmuls, source, arrays)
            self.counts["packed"] += 1
        return PassResult(model, modified=self.counts["packed"] > 0)

    @staticmethod
    def _pack(graph: ir.Graph, attention: ir.Node, matmuls: list[ir.Node], source: ir.Value, arrays: list[np.ndarray]) -> None:
        widths = [int(a.shape[1]) for a in arrays]
        name = attention.name or matmuls[0].name or "attention"
        packed = initializer(graph, f"{name}.packed_qkv.weight", np.concatenate(arrays, axis=1))
        matmul = ir.node("MatMul", [source, packed], name=f"{name}/packed_qkv/MatMul")
        split = ir.node(
            "Split", [matmul.outputs[0], ints(graph, widths)], attributes={"axis": -1}, num_outputs=3,
            name=f"{name}/packed_qkv/Split",
        )
        graph.insert_before(matmuls[0], [matmul, split])
        old_weights = [m.inputs[1] for m in matmuls]
        for old, part in zip(matmuls, split.outputs, strict=True):
            result = old.outputs[0]
            part.name, part.shape, part.type = f"{result.name}.packed", result.shape, result.type
            result.replace_all_uses_with(part)
        graph.remove(matmuls, safe=True)
        for weight in old_weights:
            if weight is not None and weight.name is not None and weight.name in graph.initializers and not list(weight.uses()):
                del graph.initializers[weight.name]
        if source.shape is not None and len(source.shape) >= 1:
            matmul.outputs[0].shape = ir.Shape([*source.shape[:-1], sum(widths)])
        matmul.outputs[0].type = matmuls[0].outputs[0].type
