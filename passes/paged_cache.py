"""The in-place cache as a pool of blocks read through a block table (kvexport's ``CacheAttention``, paged).

:class:`PagedCachePass` takes a graph whose every cache input (``past.*``, and the mixed step's
``decode.past.*``) feeds only ``kvexport.CacheAttention`` nodes (:class:`CacheAttentionPass`
ran) and ``Shape`` nodes that read its first dimension (the batch), and makes the cache paged:

- a new int32 input ``block_table`` ``[batch, max_blocks]`` (``decode.block_table`` for the
  mixed step's decode half) feeds each such node as its eighth input: row b's position t is in
  block ``block_table[b, t / block_size]`` of the pool;
- the cache inputs and outputs become the pool, ``[H, kv_blocks, block_size, D]`` (head-major:
  a KV head's consecutive blocks are one run of memory), one buffer per tensor shared by every
  row; with ``dtype`` (``FLOAT16``) the pool holds that type, which the kernel converts as it
  reads and writes (the queries, keys and values it computes with stay fp32); with ``INT8``
  it holds q8 positions: a head's D int8 codes, then their fp32 scale (4 bytes), so the pool's
  last dimension is ``D + 4``;
- a ``Shape`` that read the batch from a cache input reads it from the call's
  ``attention_mask`` (``decode.attention_mask``) instead: the pool's first dimension is its
  blocks.

Anything else reading a cache input (an 8-bit cache's ``GroupQueryAttention``, a graph whose
cache grows) is refused with a :class:`PassInputError` naming it: only the kernel reads a
paged cache. ``counts["nodes"]`` says how many attention nodes read the table.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .errors import PassInputError
from .vocabulary import BLOCK_TABLE, CACHE_ATTENTION, KVEXPORT_DOMAIN, Q8_SCALE_BYTES

_PREFIXES = ("decode.", "")  # the mixed step's decode half first: "decode.past." also ends in "past."


class PagedCachePass(InPlacePass):
    """Every in-place cache input as a pool of blocks read through a block table (see the module docstring)."""

    def __init__(self, dtype: ir.DataType | None = None) -> None:
        super().__init__()
        self.dtype = dtype  # the pool's element type (None: the cache's own)
        self.counts: dict[str, int] = {"nodes": 0}

    def requires(self, model: ir.Model) -> None:
        """Refuse a graph whose cache inputs feed anything but the kernel and a batch ``Shape``."""
        pasts = [value for value in model.graph.inputs if _prefix_of(value.name) is not None]
        if not pasts:
            raise PassInputError("the graph has no past.* cache inputs to page")
        for value in pasts:
            for node, index in value.uses():
                if not (_reads_kernel_cache(node, index) or _reads_batch(node)):
                    raise PassInputError(
                        f"{value.name} feeds {node.domain or 'ai.onnx'}.{node.op_type} {node.name!r}: only kvexport's "
                        "CacheAttention reads a paged cache (an fp32 in-place cache with the kernel library built)"
                    )

    def call(self, model: ir.Model) -> PassResult:
        """Add the block tables, wire them into the kernel's nodes, and give the cache the pool's shape."""
        graph = model.graph
        self.counts["nodes"] = 0
        tables: dict[str, ir.Value] = {}
        inputs = {value.name: value for value in graph.inputs}
        for value in list(graph.inputs):
            prefix = _prefix_of(value.name)
            if prefix is None:
                continue
            if prefix not in tables:
                tables[prefix] = ir.Value(
                    name=prefix + BLOCK_TABLE, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([f"{prefix}batch", "max_blocks"])
                )
                graph.inputs.append(tables[prefix])
            for node, index in list(value.uses()):
                if _reads_batch(node):
                    node.replace_input_with(index, inputs[prefix + "attention_mask"])
                elif index == 3:
                    padded = [*node.inputs, *[None] * (7 - len(node.inputs))]
                    node.resize_inputs(8)
                    for at, item in enumerate(padded[:7]):
                        node.replace_input_with(at, item)
                    node.replace_input_with(7, tables[prefix])
                    self.counts["nodes"] += 1
            self._as_pool(value)
        for value in graph.outputs:
            if _prefix_of((value.name or "").replace("present.", "past.", 1)) is not None:
                self._as_pool(value)
        return PassResult(model, modified=bool(tables))

    def _as_pool(self, value: ir.Value) -> None:
        value.shape = _pool_shape(value.shape, self.dtype == ir.DataType.INT8)
        if self.dtype is not None:
            value.type = ir.TensorType(self.dtype)


def _prefix_of(name: str | None) -> str | None:
    """``""`` for a ``past.*`` name, ``"decode."`` for the mixed step's ``decode.past.*``; None for anything else."""
    for prefix in _PREFIXES:
        if name is not None and name.startswith(prefix + "past."):
            return prefix
    return None


def _reads_kernel_cache(node: ir.Node, index: int) -> bool:
    return node.domain == KVEXPORT_DOMAIN and node.op_type == CACHE_ATTENTION and index in (3, 4)


def _reads_batch(node: ir.Node) -> bool:
    """A ``Shape`` of the first dimension only (start 0, end 1)."""
    if node.domain not in ("", "ai.onnx") or node.op_type != "Shape":
        return False
    start, end = node.attributes.get("start"), node.attributes.get("end")
    return start is not None and start.value == 0 and end is not None and end.value == 1


def _pool_shape(shape: ir.Shape | None, scaled: bool = False) -> ir.Shape:
    """``[H, kv_blocks, block_size, D]`` from a cache's ``[batch, H, capacity, D]`` (``scaled``: q8, ``D + 4``)."""
    dims = list(shape) if shape is not None else [None, None, None, None]
    last: int | str | ir.SymbolicDim | None = dims[3]
    if scaled:
        last = last + Q8_SCALE_BYTES if isinstance(last, int) else "q8_position"
    return ir.Shape([dims[1], "kv_blocks", "block_size", last])
