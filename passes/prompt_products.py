"""A prompt graph's block-quantized products in bf16, on the CPU's bf16 units (``kvexport.PromptMatMul``).

A prompt is GEMM work: many rows through every weight. ONNX Runtime 1.31.1's ``MatMulNBits``
(int8 blocks of 32 at accuracy level 4, Q8_0's arithmetic) runs SmolLM2-135M's projections at
0.22-0.26 TFLOP/s on 2 Sapphire Rapids cores, where the same cores do 2.1 TFLOP/s in bf16 and
2-3.6 TOPS in uint8 x int8 (``benchmarks/roofline.py``). A decode step is one row a sequence and
reads every weight: bandwidth-bound, where the int8 blocks' half of bf16's bytes wins. So the
graph that runs prompts and the one that decodes need not hold the weights alike.

:class:`PromptProductsPass` replaces each ``MatMulNBits`` (4 or 8 bits, integer or default zero
points, no group index) whose output width is not the LM head's (``skip_width``: the head runs on
one row a sequence in a prompt too) by ``kvexport.PromptMatMul`` over the same weights
dequantized and rounded to bf16, in the layout the kernel reads (:func:`pack_bf16`; the bias
kept). A Q8_0 block's value ``q * d`` keeps 8 significant bits of its 18: a relative change of at
most 2**-9, against the block's own step of up to 1/127 of its largest magnitude. The
activations go to bf16 too, where ``MatMulNBits`` quantizes them to int8 blocks: the product is
closer to the float one than the decode graph's. ``counts["nodes"]`` says how many nodes were
replaced. The runtime applies it to the session that runs prompts only
(:func:`kvexport.runtime.session.open_prompt_session`), where the kernel has the CPU's bf16 units.

With ``fuse`` (the default) the products that read the same rows become one kernel: a SwiGLU
MLP's gate and up projections with their ``silu(gate) * up`` (the kernel's ``gated``: the
activation applied as its tiles are stored, one output of half their width; the ``Sigmoid`` and
two ``Mul`` nodes go), and the rest, e.g. a layer's query, key and value, as one product with one
output each (``splits``). On 2 Sapphire Rapids cores SmolLM2-135M's key and value products (192
columns) ran at 0.66 TFLOP/s alone, and a gate's or up's 1536-column output was written, read
back by the activation and written again. ``counts["kernels"]`` says how many kernels the pass wrote,
``counts["gated"]`` and ``counts["split"]`` how many of each kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .values import initializer, stand_in
from .vocabulary import KVEXPORT_DOMAIN, MATMUL_NBITS, MS_DOMAIN, PROMPT_MATMUL

GROUP = 16  # the kernel's columns a group
STEP = 32  # the kernel's K a step
MAX_SPLITS = 8  # the kernel's outputs at most


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to bf16 (to nearest even), as their uint16 bit patterns."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def pack_bf16(weight: np.ndarray) -> np.ndarray:
    """``weight`` [K, N] in the kernel's layout: bf16 bits [N/16, K/2, 16, 2], zero past K and N (rounded up to 32 and 16)."""
    k, n = weight.shape
    k_pad, groups = -(-k // STEP) * STEP, -(-n // GROUP)
    full = np.zeros((k_pad, groups * GROUP), np.float32)
    full[:k, :n] = weight
    return bf16_bits(full).reshape(k_pad // 2, 2, groups, GROUP).transpose(2, 0, 3, 1).copy()


def pack_gated(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Two [K, N] weights in the gated kernel's layout: their 16-column groups alternating (gate first), each padded to 16."""
    k, n = gate.shape
    width = -(-n // GROUP) * GROUP
    both = np.zeros((k, 2, width // GROUP, GROUP), np.float32)
    both[:, 0].reshape(k, width)[:, :n] = gate
    both[:, 1].reshape(k, width)[:, :n] = up
    return pack_bf16(both.transpose(0, 2, 1, 3).reshape(k, 2 * width))


def dequantize_nbits(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, bits: int) -> np.ndarray:
    """A ``MatMulNBits`` weight as floats [K, N]: ``(q - z) * scale`` per block (z: ``2**(bits-1)`` where not given).

    ``codes`` [N, blocks, bs*bits/8] (4-bit codes two a byte, the low nibble first), ``scales``
    [N, blocks] (or flat), ``zero_points`` packed as the codes [N, ceil(blocks*bits/8)].
    """
    n, blocks = codes.shape[:2]
    if bits == 4:
        q = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(n, blocks, -1)
    else:
        q = codes
    if zero_points is None:
        zero = np.full((n, blocks), 1 << (bits - 1), np.float32)
    elif bits == 4:
        zero = np.stack([zero_points & 0x0F, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
    else:
        zero = zero_points.reshape(n, -1)[:, :blocks].astype(np.float32)
    values = (q.astype(np.float32) - zero[..., None]) * scales.reshape(n, blocks).astype(np.float32)[..., None]  # fp32, as the op computes
    return values.reshape(n, -1)[:, :k].T


class PromptProductsPass(InPlacePass):
    """Each block-quantized ``MatMulNBits`` but the LM head's as kvexport's bf16 ``PromptMatMul`` (see the module docstring).

    ``placeholders``: each packed weight's initializer is an empty placeholder, and the arrays
    are kept in :attr:`weights`, for a session to take from memory
    (``SessionOptions.add_initializer``: ONNX Runtime reads them where they are, where a graph's
    own initializers, or external ones added from memory, are copied: 0.2 GB more for SmolLM2-135M).
    ``fuse``: products of the same rows as one kernel (the module docstring).
    """

    def __init__(self, skip_width: int | None = None, *, placeholders: bool = False, fuse: bool = True) -> None:
        super().__init__()
        self.skip_width = skip_width
        self.placeholders = placeholders
        self.fuse = fuse
        self.counts: dict[str, int] = {"nodes": 0, "kernels": 0, "gated": 0, "split": 0}
        self.weights: dict[str, np.ndarray] = {}  # with ``placeholders``: each packed weight by its initializer's name

    def call(self, model: ir.Model) -> PassResult:
        """Replace every node the kernel can take in the main graph."""
        self.counts = {"nodes": 0, "kernels": 0, "gated": 0, "split": 0}
        self.weights = {}
        graph = model.graph
        by_rows: dict[ir.Value, list[tuple[ir.Node, np.ndarray]]] = {}
        for node in list(graph):
            weight = _dequantized(node, self.skip_width)
            if weight is not None:
                by_rows.setdefault(node.inputs[0], []).append((node, weight))  # type: ignore[arg-type]
        for products in by_rows.values():
            if self.fuse:
                products = self._gate(graph, products)
            if self.fuse and len(products) > 1:
                products = self._split(graph, products)
            for node, weight in products:
                self._write(graph, [node], [weight], pack_bf16(weight), {"K": weight.shape[0], "N": weight.shape[1]})
        if self.counts["nodes"]:
            model.opset_imports.setdefault(KVEXPORT_DOMAIN, 1)
        return PassResult(model, modified=self.counts["nodes"] > 0)

    def _gate(self, graph: ir.Graph, products: list[tuple[ir.Node, np.ndarray]]) -> list[tuple[ir.Node, np.ndarray]]:
        """Each gate and up pair among ``products`` as one gated kernel; the products left."""
        left = list(products)
        for gate, gate_weight in products:
            if all(node is not gate for node, _ in left):
                continue  # already taken as another pair's up
            match = _swiglu(gate, [node for node, _ in left if node is not gate])
            if match is None:
                continue
            up, ends = match
            up_weight = next(weight for node, weight in left if node is up)
            if up_weight.shape != gate_weight.shape:
                continue
            k, n = gate_weight.shape
            kernel = self._write(graph, [], [], pack_gated(gate_weight, up_weight), {"K": k, "N": n, "gated": 1}, before=gate)
            stand_in(graph, ends[-1].outputs[0], kernel.outputs[0], f"kvexport.prompt_product{self.counts['nodes']}")
            for node in (*reversed(ends), gate, up):
                graph.remove(node, safe=True)
            self.counts["nodes"] += 2
            self.counts["gated"] += 1
            left = [(node, weight) for node, weight in left if node is not gate and node is not up]
        return left

    def _split(self, graph: ir.Graph, products: list[tuple[ir.Node, np.ndarray]]) -> list[tuple[ir.Node, np.ndarray]]:
        """``products`` (of the same rows) as one kernel with an output each, where the kernel can split them; the rest."""
        whole = [(node, weight) for node, weight in products if weight.shape[1] % GROUP == 0]
        ragged = [(node, weight) for node, weight in products if weight.shape[1] % GROUP != 0]
        taken = (whole + ragged[:1])[:MAX_SPLITS]  # every output but the last starts at a whole group
        if len(taken) < 2 or len({weight.shape[0] for _, weight in taken}) != 1:
            return products
        nodes, weights = [node for node, _ in taken], [weight for _, weight in taken]
        widths = [weight.shape[1] for weight in weights]
        attributes = {"K": weights[0].shape[0], "N": sum(widths), "splits": widths}
        first = next(node for node, _ in products if any(node is other for other in nodes))  # the graph's order
        self._write(graph, nodes, weights, pack_bf16(np.concatenate(weights, axis=1)), attributes, before=first)
        self.counts["split"] += 1
        return [(node, weight) for node, weight in products if all(node is not other for other in nodes)]

    def _write(
        self, graph: ir.Graph, nodes: list[ir.Node], weights: list[np.ndarray], packed: np.ndarray,
        attributes: dict[str, Any], before: ir.Node | None = None,
    ) -> ir.Node:
        """The kernel over ``packed`` in ``nodes``' place (their outputs its, their biases one), before ``before`` if given."""
        name = f"kvexport.prompt_weight{self.counts['kernels']}"
        self.counts["kernels"] += 1
        tensor = self._tensor(packed, name)
        initializer = ir.Value(name=name, shape=ir.Shape(packed.shape), type=ir.TensorType(ir.DataType.BFLOAT16), const_value=tensor)
        graph.register_initializer(initializer)
        anchor = before or nodes[0]
        assert anchor is not None
        inputs: list[ir.Value | None] = [anchor.inputs[0], initializer]
        biases = [_bias(node) for node in nodes]
        if any(bias is not None for bias in biases):
            inputs.append(_joined_bias(graph, biases, weights, name))
        kernel = ir.node(
            PROMPT_MATMUL, inputs, attributes=attributes, domain=KVEXPORT_DOMAIN, name=anchor.name, num_outputs=max(1, len(nodes))
        )
        graph.insert_before(anchor, kernel)
        for node, output in zip(nodes, kernel.outputs, strict=False):
            stand_in(graph, node.outputs[0], output, f"kvexport.prompt_product{self.counts['nodes']}")
            graph.remove(node, safe=True)
            self.counts["nodes"] += 1
        return kernel

    def _tensor(self, packed: np.ndarray, name: str) -> ir.Tensor:
        if not self.placeholders:
            return ir.Tensor(packed, dtype=ir.DataType.BFLOAT16, name=name)
        self.weights[name] = packed
        return ir.Tensor(np.zeros(0, np.uint16), dtype=ir.DataType.BFLOAT16, name=name)


def _bias(node: ir.Node) -> ir.Value | None:
    inputs = list(node.inputs) + [None] * max(0, 6 - len(node.inputs))
    return inputs[5]


def _joined_bias(graph: ir.Graph, biases: list[ir.Value | None], weights: list[np.ndarray], name: str) -> ir.Value:
    """One bias for the split kernel: each product's own (constant), zeros where it has none."""
    if len(biases) == 1 and biases[0] is not None:
        return biases[0]
    parts = []
    for bias, weight in zip(biases, weights, strict=True):
        value = bias.const_value.numpy().astype(np.float32).reshape(-1) if bias is not None and bias.const_value is not None else None
        parts.append(value if value is not None else np.zeros(weight.shape[1], np.float32))
    return initializer(graph, f"{name}.bias", np.concatenate(parts))


def _only_use(value: ir.Value) -> ir.Node | None:
    """The one node that reads ``value`` (once), where it is not a graph output; else None."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node


def _swiglu(gate: ir.Node, others: list[ir.Node]) -> tuple[ir.Node, tuple[ir.Node, ir.Node, ir.Node]] | None:
    """``Mul(Mul(g, Sigmoid(g)), u)`` over ``gate``'s output g and one of ``others``' u, with nothing else reading them.

    The up node and the pattern's nodes (Sigmoid, the inner Mul, the outer Mul), or None.
    """
    g = gate.outputs[0]
    if _bias(gate) is not None or g.is_graph_output() or len(g.uses()) != 2:
        return None
    readers = {use.node.op_type: use.node for use in g.uses()}
    sigmoid, inner = readers.get("Sigmoid"), readers.get("Mul")
    if sigmoid is None or inner is None or inner.domain not in ("", "ai.onnx") or sigmoid.domain not in ("", "ai.onnx"):
        return None
    if _only_use(sigmoid.outputs[0]) is not inner or {id(value) for value in inner.inputs} != {id(g), id(sigmoid.outputs[0])}:
        return None
    outer = _only_use(inner.outputs[0])
    if outer is None or outer.op_type != "Mul" or outer.domain not in ("", "ai.onnx") or len(outer.inputs) != 2:
        return None
    other = outer.inputs[1] if outer.inputs[0] is inner.outputs[0] else outer.inputs[0]
    up = next((node for node in others if node.outputs[0] is other and _bias(node) is None), None)
    if up is None or other is None or _only_use(other) is not outer:
        return None
    return up, (sigmoid, inner, outer)


def _dequantized(node: ir.Node, skip_width: int | None) -> np.ndarray | None:
    """The node's weight as floats [K, N] where the kernel can take the node, else None."""
    if node.domain != MS_DOMAIN or node.op_type != MATMUL_NBITS:
        return None
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    bits, k, n = int(attributes.get("bits", 4)), int(attributes["K"]), int(attributes["N"])
    if bits not in (4, 8) or n == skip_width:
        return None
    inputs = list(node.inputs) + [None] * max(0, 6 - len(node.inputs))
    activation, codes, scales, zero_points, group_index = inputs[:5]
    if activation is None or activation.dtype not in (None, ir.DataType.FLOAT) or group_index is not None:
        return None
    constants = [codes, scales] + ([zero_points] if zero_points is not None else [])
    if any(value is None or value.const_value is None for value in constants):
        return None
    if zero_points is not None and zero_points.dtype != ir.DataType.UINT8:
        return None  # float zero points: the offsets' own arithmetic, not taken
    assert codes is not None and scales is not None and codes.const_value is not None and scales.const_value is not None
    zero = zero_points.const_value.numpy() if zero_points is not None and zero_points.const_value is not None else None
    return dequantize_nbits(codes.const_value.numpy(), scales.const_value.numpy(), zero, k, bits)
