"""Cache buffers on the session's device, bound to ONNX Runtime by address.

- :class:`CacheBanks`: flat buffers, one per ``past``/``present`` tensor, in one bank
  (the in-place layout) or two (the concat layout's ping-pong); the Generator's.
- :class:`SlotCache`: an in-place cache of ``slots`` rows, each a sequence of its own;
  the serving engine's and speculative decoding's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from kvexport.bundle.manifest import Manifest
from kvexport.errors import ManifestError
from kvexport.passes.cache_names import cache_names
from kvexport.passes.vocabulary import BLOCK_TABLE, PAGE_TOKENS, POOL_DTYPES, Q8_SCALE_BYTES

_NP_DTYPES: dict[str, type[np.floating[Any]]] = {"fp32": np.float32, "fp16": np.float16}
# a cache's element type: the graph's float, or int8 / int4 (two 4-bit values a uint8), or a paged pool's q8 (int8
# codes and each position's fp32 scale as 4 more bytes)
_CACHE_DTYPES: dict[str, type[np.generic]] = {**_NP_DTYPES, "int8": np.int8, "int4": np.uint8, "q8": np.int8}


def check_pool_dtype(dtype: str) -> None:
    """One line where a paged pool can't hold ``dtype`` (:data:`POOL_DTYPES`: what kvexport's kernel reads)."""
    if dtype not in POOL_DTYPES:
        raise ManifestError(f"a paged cache of {dtype}: choose {', '.join(POOL_DTYPES)}")


def pool_manifest(manifest: Manifest, dtype: str) -> Manifest:
    """``manifest`` as a paged pool of ``dtype`` (:data:`POOL_DTYPES`) sees it: the same, with that cache dtype."""
    check_pool_dtype(dtype)
    return dataclasses.replace(manifest, cache={**manifest.cache, "dtype": dtype})


def numpy_dtype(dtype: str) -> type[np.floating[Any]]:
    """The numpy type of a manifest's ``dtype`` (fp32, fp16), or one line saying it is unknown."""
    if dtype not in _NP_DTYPES:
        raise ManifestError(f"manifest dtype {dtype!r} is not one the runner knows (fp32, fp16)")
    return _NP_DTYPES[dtype]


def cache_layout_of(manifest: Manifest) -> tuple[type[np.generic], int]:
    """The cache's numpy element type and its elements per cached position of one head.

    ``head_dim``; halved at int4; a q8 pool's 4 scale bytes after its ``head_dim`` codes.
    """
    kind = manifest.cache_dtype
    if kind not in _CACHE_DTYPES:
        raise ManifestError(f"manifest cache dtype {kind!r} is not one the runner knows ({', '.join(_CACHE_DTYPES)})")
    head_dim = manifest.dims.head_dim
    stored = {"int4": head_dim // 2, "q8": head_dim + Q8_SCALE_BYTES}.get(kind, head_dim)
    return _CACHE_DTYPES[kind], stored


def cache_row_bytes(manifest: Manifest, capacity: int) -> int:
    """Bytes one sequence of ``capacity`` tokens takes in one cache tensor (``[H, capacity, D]``, the cache's dtype)."""
    element, stored_dim = cache_layout_of(manifest)
    return manifest.dims.num_kv_heads * capacity * stored_dim * np.dtype(element).itemsize

class CacheBanks:
    """Banks of flat cache buffers on the device; views of any length are bound by pointer.

    Two banks (ping-pong) for the ``concat`` layout, one for ``shared-buffer``.
    """

    def __init__(self, tensors: int, capacity: int, dtype: type, device: str, banks: int = 2) -> None:
        self.device = device
        self.dtype = dtype
        self._owners: list[Any] = []  # keeps the buffers alive
        self.pointers: list[list[int]] = []  # [bank][tensor index in cache_names order]
        for _ in range(banks):
            bank: list[int] = []
            for _ in range(tensors):
                if device == "cpu":
                    array: np.ndarray = np.empty(capacity, dtype=dtype)
                    bank.append(array.ctypes.data)
                    self._owners.append(array)
                else:
                    value = ort.OrtValue.ortvalue_from_shape_and_type([capacity], dtype, device, 0)
                    bank.append(value.data_ptr())
                    self._owners.append(value)
            self.pointers.append(bank)

    def bind(
        self, binding: ort.IOBinding, names: list[str], bank: int, shape: tuple[int, ...], *, output: bool
    ) -> None:
        """Bind tensor i of ``names`` to the front of buffer i of ``bank``, viewed as ``shape``."""
        for name, pointer in zip(names, self.pointers[bank], strict=True):
            if output:
                binding.bind_output(name, self.device, 0, self.dtype, list(shape), pointer)
            else:
                binding.bind_input(name, self.device, 0, self.dtype, list(shape), pointer)

    def release_memory(self) -> int:
        """Give the CPU buffers' pages back to the system (Linux ``MADV_DONTNEED``; their values are lost); the bytes given back.

        Untouched pages of a large buffer take no memory; once written (a warm-up's rows) they
        stay resident until the process ends, unless given back. They are read as zeros, and
        take memory again, when next written. Buffers on the device, and other systems: 0.
        """
        if self.device != "cpu" or not sys.platform.startswith("linux"):
            return 0
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page, released = mmap.PAGESIZE, 0
        for owner in self._owners:
            start = -(-owner.ctypes.data // page) * page  # whole pages inside the buffer only
            end = (owner.ctypes.data + owner.nbytes) // page * page
            if end > start and madvise(start, end - start, 4) == 0:  # 4: MADV_DONTNEED
                released += end - start
        return released

    def host_view(self, bank: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
        """Buffer ``index`` of ``bank`` itself, viewed as ``shape`` (CPU buffers only)."""
        owner = self._owners[bank * len(self.pointers[bank]) + index]
        if not isinstance(owner, np.ndarray):
            raise ValueError("the cache lives on the device; only CPU buffers have a host view")
        return owner[: int(np.prod(shape))].reshape(shape)

    def read(self, bank: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
        """A host copy of the front of buffer ``index`` of ``bank``, viewed as ``shape``."""
        owner = self._owners[bank * len(self.pointers[bank]) + index]
        count = int(np.prod(shape))
        flat = owner[:count] if isinstance(owner, np.ndarray) else owner.numpy()[:count]
        return np.array(flat.reshape(shape))


class SlotCache:
    """An in-place cache of ``slots`` rows: one ``[slots, H, capacity, D]`` buffer per cache tensor.

    Rows are bound by address, a run at a time: ``bind(binding, first, rows)`` binds every
    ``past.*`` input and its ``present.*`` output to the same rows ``first..first+rows``, so
    a prompt can be prefilled at batch 1 into its own row and rows of different lengths
    decoded together (the serving engine, and verify's case for it).
    """

    def __init__(self, manifest: Manifest, provider: str, slots: int, capacity: int) -> None:
        self._describe(manifest, slots, capacity)
        device = "cuda" if provider == "cuda" else "cpu"
        self.banks = CacheBanks(len(self.past), slots * int(np.prod(self.row_shape)), self.cache_dtype, device, banks=1)

    def _describe(self, manifest: Manifest, slots: int, capacity: int) -> None:
        """What a slot addresses, whatever holds it: dtypes, a row's shape and bytes, the cache's names."""
        dims = manifest.dims
        self.manifest = manifest
        self.dtype = numpy_dtype(manifest.dtype)  # the logits'
        self.cache_dtype, stored_dim = cache_layout_of(manifest)
        self.slots = slots
        self.row_shape = (dims.num_kv_heads, capacity, stored_dim)
        self.past = cache_names("past", dims.num_layers)
        self.present = cache_names("present", dims.num_layers)
        self.row_bytes = cache_row_bytes(manifest, capacity)
        self._row_bindings: dict[tuple[int, int, int], ort.IOBinding] = {}  # (session, first row, rows) -> binding

    def bind(self, binding: ort.IOBinding, first: int, rows: int, *, prefix: str = "") -> None:
        """Bind past and present of every layer to rows ``first..first+rows`` of the buffers.

        ``prefix`` names another set of cache inputs and outputs (the mixed step's
        ``decode.past.*`` / ``decode.present.*``), bound to the same buffers.
        """
        shape = [rows, *self.row_shape]
        for index, (past, present) in enumerate(zip(self.past, self.present, strict=True)):
            pointer = self.banks.pointers[0][index] + first * self.row_bytes
            binding.bind_input(prefix + past, self.banks.device, 0, self.cache_dtype, shape, pointer)
            binding.bind_output(prefix + present, self.banks.device, 0, self.cache_dtype, shape, pointer)

    def run_piece(
        self, session: ort.InferenceSession, row: int, piece: Sequence[int], start: int, run_options: ort.RunOptions | None = None
    ) -> np.ndarray:
        """Run ``piece`` at batch 1 after the ``start`` tokens cached in ``row`` (the prefill graph).

        Its keys and values land in the row's positions ``start..``; returns the logits
        after each token (an ``--all-logits`` graph) or after the last: [n or 1, V], fp32.
        ``run_options``: e.g. a CUDA-graph session's, that runs it uncaptured.
        """
        return self._run(session, row, np.array([piece], np.int64), start, run_options)[0]

    def run_rows(
        self,
        session: ort.InferenceSession,
        first: int,
        pieces: Sequence[Sequence[int]],
        start: int = 0,
        run_options: ort.RunOptions | None = None,
    ) -> np.ndarray:
        """Run ``pieces``, all one length, in rows ``first..`` after the ``start`` tokens each row holds (one call).

        GroupQueryAttention runs a batch of several tokens a row only when no row has a past
        (its first-prompt path), so with ``start`` 0 every row starts at position 0; rows
        after a past of ``start`` tokens need a graph whose every attention the CPU products
        run (an 8-bit cache's: ``kvexport.rows_after_past`` in its metadata; the op alone refuses the call). The
        pieces are one length: no padding, each row's last position is its own. The keys and
        values land in each row's positions ``start..``; returns each row's logits after each
        token (an ``--all-logits`` graph) or after the last: [rows, n or 1, V], fp32. A row's
        logits are the ones :meth:`run_piece` gives for its piece alone.
        """
        length = len(pieces[0])
        if any(len(piece) != length for piece in pieces):
            raise ValueError(f"pieces of {sorted({len(piece) for piece in pieces})} tokens: one call takes pieces of one length")
        return self._run(session, first, np.array(pieces, np.int64), start, run_options)

    def _run(
        self, session: ort.InferenceSession, first: int, ids: np.ndarray, start: int, run_options: ort.RunOptions | None = None
    ) -> np.ndarray:
        """``ids`` ([rows, n]) into rows ``first..`` after the ``start`` tokens each holds; logits [rows, n or 1, V], fp32."""
        rows, length = ids.shape
        end = start + length
        binding = self._row_bindings.get((id(session), first, rows))
        if binding is None:  # the cache stays bound; each call rebinds only the inputs and logits
            binding = self._row_bindings[(id(session), first, rows)] = session.io_binding()
            self.bind(binding, first, rows)
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", np.ones((rows, end), np.int64))
        binding.bind_cpu_input("position_ids", np.tile(np.arange(start, end, dtype=np.int64), (rows, 1)))
        count = length if self.manifest.all_logits else 1
        logits = np.empty((rows, count, self.manifest.dims.vocab_size), self.dtype)
        binding.bind_output("logits", "cpu", 0, self.dtype, list(logits.shape), logits.ctypes.data)
        session.run_with_iobinding(binding, run_options)
        return logits.astype(np.float32, copy=False)

    @property
    def can_copy_rows(self) -> bool:
        """Whether :meth:`copy_rows` works here (CPU buffers)."""
        return self.banks.device == "cpu"

    def copy_rows(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``source`` into row ``target``, every tensor (CPU)."""
        for index in range(len(self.past)):
            view = self.banks.host_view(0, index, (self.slots, *self.row_shape))
            view[target, :, :length] = view[source, :, :length]

    def read(self, index: int, row: int, length: int) -> np.ndarray:
        """A host copy of cache tensor ``index`` of one row, its first ``length`` positions: [1, H, length, D]."""
        return self.banks.read(0, index, (self.slots, *self.row_shape))[row : row + 1, :, :length]


class PagedCache(SlotCache):
    """The serving engine's cache as a pool of ``blocks`` blocks of :data:`PAGE_TOKENS` positions, read through a block table.

    One ``[H, blocks, PAGE_TOKENS, D]`` buffer per cache tensor (head-major: a KV head's
    consecutive blocks are one run of memory), shared by every slot, and
    :attr:`tables` (int32 ``[slots, capacity / PAGE_TOKENS]``): slot s's position t is in
    block ``tables[s, t // PAGE_TOKENS]``. The graph reads it as its ``block_table`` input
    (:class:`~kvexport.passes.PagedCachePass`, kvexport's CPU kernel); a slot addresses
    ``capacity`` positions, rounded up to whole blocks. The table is bound by
    address, so whoever hands out the blocks (:class:`~kvexport.serving.blocks.BlockManager`)
    writes it in place between calls. Untouched blocks take no memory: the pool is allocated,
    never written whole.
    """

    def __init__(self, manifest: Manifest, provider: str, slots: int, capacity: int, blocks: int) -> None:
        if provider == "cuda":
            raise ManifestError("the paged cache runs on CPU only (kvexport's attention kernel reads it)")
        self._describe(manifest, slots, capacity)
        heads, _, stored_dim = self.row_shape
        self.blocks = blocks
        self.block_shape = (heads, PAGE_TOKENS, stored_dim)  # one block's every head
        self.pool_shape = (heads, blocks, PAGE_TOKENS, stored_dim)
        self.block_bytes = cache_row_bytes(manifest, PAGE_TOKENS)
        self.banks = CacheBanks(len(self.past), blocks * int(np.prod(self.block_shape)), self.cache_dtype, "cpu", banks=1)
        self.tables = np.zeros((slots, -(-capacity // PAGE_TOKENS)), np.int32)

    @property
    def pool_bytes(self) -> int:
        """Bytes the pool reserves (every layer, K and V); the blocks no slot ever wrote take no memory."""
        return len(self.past) * self.blocks * self.block_bytes

    def bind(self, binding: ort.IOBinding, first: int, rows: int, *, prefix: str = "", table: np.ndarray | None = None) -> None:
        """Bind every tensor's pool as past and present, and rows ``first..first+rows`` of the tables as ``block_table``.

        ``table``: bind that one instead (int32 ``[rows, W]``, kept alive by the caller): slots' rows gathered for a call.
        """
        shape = list(self.pool_shape)
        for index, (past, present) in enumerate(zip(self.past, self.present, strict=True)):
            pointer = self.banks.pointers[0][index]
            binding.bind_input(prefix + past, "cpu", 0, self.cache_dtype, shape, pointer)
            binding.bind_output(prefix + present, "cpu", 0, self.cache_dtype, shape, pointer)
        table = self.tables[first : first + rows] if table is None else table
        binding.bind_input(prefix + BLOCK_TABLE, "cpu", 0, np.int32, list(table.shape), table.ctypes.data)

    @property
    def can_copy_rows(self) -> bool:
        """Rows are not copied here: a prefix's blocks are shared, a partly filled block copied (:meth:`copy_blocks`)."""
        return False

    def copy_rows(self, source: int, target: int, length: int) -> None:
        """Not in the paged layout (see :meth:`copy_blocks`)."""
        raise NotImplementedError("the paged cache shares a prefix's blocks; it copies whole blocks only (copy_blocks)")

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy block ``source`` into block ``target`` for each pair, every tensor."""
        for index in range(len(self.past)):
            view = self.banks.host_view(0, index, self.pool_shape)
            for source, target in pairs:
                view[:, target] = view[:, source]

    def read(self, index: int, row: int, length: int) -> np.ndarray:
        """A host copy of cache tensor ``index`` of slot ``row``, its first ``length`` positions through its table: [1, H, length, D].

        A q8 pool's positions come as stored: [1, H, length, D + 4], the codes then the scale's bytes.
        """
        view = self.banks.host_view(0, index, self.pool_shape)
        blocks = self.tables[row, : -(-length // PAGE_TOKENS)]
        return np.concatenate([view[:, block] for block in blocks], axis=1)[None, :, :length].copy()
