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
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .values import stand_in
from .vocabulary import KVEXPORT_DOMAIN, MATMUL_NBITS, MS_DOMAIN, PROMPT_MATMUL

GROUP = 16  # the kernel's columns a group
STEP = 32  # the kernel's K a step


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
    """

    def __init__(self, skip_width: int | None = None, *, placeholders: bool = False) -> None:
        super().__init__()
        self.skip_width = skip_width
        self.placeholders = placeholders
        self.counts: dict[str, int] = {"nodes": 0}
        self.weights: dict[str, np.ndarray] = {}  # with ``placeholders``: each packed weight by its initializer's name

    def call(self, model: ir.Model) -> PassResult:
        """Replace every node the kernel can take in the main graph."""
        self.counts["nodes"] = 0
        self.weights = {}
        graph = model.graph
        for node in list(graph):
            weight = _dequantized(node, self.skip_width)
            if weight is not None:
                packed = pack_bf16(weight)
                name = f"kvexport.prompt_weight{self.counts['nodes']}"
                tensor = self._tensor(packed, name)
                _replace(graph, node, tensor, packed.shape, weight.shape, self.counts["nodes"])
                self.counts["nodes"] += 1
        if self.counts["nodes"]:
            model.opset_imports.setdefault(KVEXPORT_DOMAIN, 1)
        return PassResult(model, modified=self.counts["nodes"] > 0)

    def _tensor(self, packed: np.ndarray, name: str) -> ir.Tensor:
        if not self.placeholders:
            return ir.Tensor(packed, dtype=ir.DataType.BFLOAT16, name=name)
        self.weights[name] = packed
        return ir.Tensor(np.zeros(0, np.uint16), dtype=ir.DataType.BFLOAT16, name=name)


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


def _replace(
    graph: ir.Graph, node: ir.Node, tensor: ir.Tensor, packed_shape: tuple[int, ...], weight_shape: tuple[int, ...], number: int
) -> None:
    """The kernel in the node's place: the activation, the packed bf16 weight and the bias (if any), the same output."""
    k, n = weight_shape
    initializer = ir.Value(name=tensor.name, shape=ir.Shape(packed_shape), type=ir.TensorType(ir.DataType.BFLOAT16), const_value=tensor)
    graph.register_initializer(initializer)
    inputs = list(node.inputs) + [None] * max(0, 6 - len(node.inputs))
    bias = inputs[5]
    kernel = ir.node(
        PROMPT_MATMUL,
        [inputs[0], initializer] + ([bias] if bias is not None else []),
        attributes={"K": k, "N": n},
        domain=KVEXPORT_DOMAIN,
        name=node.name,
    )
    graph.insert_before(node, kernel)
    stand_in(graph, node.outputs[0], kernel.outputs[0], f"kvexport.prompt_product{number}")
    graph.remove(node, safe=True)
