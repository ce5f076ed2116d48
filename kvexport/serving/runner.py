"""The model runner: the session, the slot buffers and the bindings; runs a step's plan, returns its logits as data.

:meth:`ModelRunner.execute` takes a step's :class:`~kvexport.serving.scheduler.CallPlan`
(the admitted requests' row copies, then one call) and returns a :class:`ModelOutput`: the
logits of each prompt piece and of the decode rows, or a speculative round's tokens, and
the call's time. It changes no request or scheduler state.

The prefill graph of an in-place export serves both phases, so the runner opens one ONNX
Runtime session, whose intra-op threads may spin between runs without a second
session's pool fighting them for the cores. A prompt chunk runs at batch 1 straight into
its slot's region of the cache (bound by address, no copy); fresh prompts' first pieces
of one length, in consecutive slots, may run as one call (:meth:`ModelRunner.run_rows`).
A decode call runs every row up to the highest running slot, each with its own token,
position and mask row, over a mask as wide as the capacity; its binding is made once
per row count and kept, so shapes and addresses stay the same from step to step.

With ``cuda_graph`` (CUDA) the decode call of each row count is captured as a CUDA graph
on its first runs and replayed after (:class:`~kvexport.runtime.cuda_graph.FixedDecode`,
keyed by (rows, capacity): the engine's capacity is fixed, so one graph per row count);
prompt pieces run uncaptured. ``static_decode`` runs the same fixed-address decode
without capture, on any provider.

With ``mixed``, a second session runs the mixed step's graph (derived from the prefill
graph when the runner opens, :mod:`kvexport.passes.mixed_step`): one call that prefills a
prompt chunk into its slot and decodes the running rows, the chunk's and the rows' tokens
packed into the same GEMMs. It packs the weights a second time (that session's memory).

With ``paged_blocks`` (CPU, an fp32 cache kvexport's kernel reads) the cache is a pool of that
many blocks of ``pool_dtype`` (fp32; fp16: half the bytes; q8: int8 codes and a scale a position and head; the
kernel converts fp16 and q8 as it reads and writes) (:class:`~kvexport.runtime.cache.PagedCache`) and every session reads it through
its ``block_table`` input (:class:`~kvexport.passes.PagedCachePass`): a slot is a row of the
table, and the scheduler's :class:`~kvexport.serving.blocks.BlockManager` writes the table in
place. Bindings stay as they are (the table's rows are bound by address); a prefix is shared
by blocks, and the admitted requests' block copies run before the step's call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from kvexport.errors import KvexportError, first_line
from kvexport.passes.vocabulary import ROWS_AFTER_PAST
from kvexport.runtime.cache import PagedCache, SlotCache, numpy_dtype, pool_manifest
from kvexport.runtime.cuda_graph import (
    NO_CAPTURE,
    FixedDecode,
    GraphIds,
    graph_run_options,
    require_capture,
)
from kvexport.runtime.opened import OpenedExport
from kvexport.runtime.sampling import SamplingConfig
from kvexport.runtime.session import (
    open_mixed_session,
    open_session,
    prompt_session_for,
    session_options,
)
from kvexport.runtime.speculative import Drafter, speculative_round
from kvexport.serving.scheduler import (
    CallPlan,
    DecodePlan,
    MixedCall,
    PrefillBatch,
    PrefillChunk,
    PrefixJob,
    SpeculativePlan,
)

DECODE_PREFIX = "decode."  # the mixed graph's decode half: decode.attention_mask, decode.past.*, decode.present.* (passes/mixed_step.py)


@dataclass
class ModelOutput:
    """What one step's call gave, as data.

    ``prompt``: the logits of each prompt chunk it ran, in :attr:`CallPlan.chunks`' order
    ([n or 1, V], fp32). ``decode``: the decode rows' ([rows, V], the session's dtype; a
    view, valid until the next call). ``drafts`` / ``kept`` / ``accepted``: a speculative
    round's drafts, how many were kept, and the tokens it took (the kept drafts and the
    next). ``error``: why a prefix was not cached. ``seconds``: the call's time.
    """

    prompt: list[np.ndarray] = field(default_factory=list)
    decode: np.ndarray | None = None
    drafts: list[int] = field(default_factory=list)
    kept: int = 0
    accepted: list[int] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


class ModelRunner:
    """Runs prompt chunks and decode calls over ``slots`` rows of ``capacity`` tokens (``drafter``: speculative rounds too).

    ``cuda_graph``: capture each row count's decode call as a CUDA graph (CUDA only, a graph
    a capture can hold); ``static_decode``: the same fixed-address decode call uncaptured.
    ``paged_blocks``: the paged cache's pool, in blocks of ``pool_dtype`` (see the module docstring);
    a graph the kernel can't page raises :class:`~kvexport.errors.ManifestError`.
    """

    def __init__(
        self,
        opened: OpenedExport,
        slots: int,
        capacity: int,
        *,
        intra_op_threads: int | None = None,
        spinning: bool = True,
        mixed: bool = False,
        drafter: Drafter | None = None,
        cuda_graph: bool = False,
        static_decode: bool = False,
        prompt_products: bool = False,
        paged_blocks: int | None = None,
        pool_dtype: str = "fp32",
        bf16_decode_rows: int = 0,
    ) -> None:
        manifest = opened.manifest
        paged = pool_dtype if paged_blocks is not None else None
        if paged and (cuda_graph or static_decode):
            raise KvexportError("the paged cache has no fixed-address decode call (cuda_graph, static_decode): use the slot layout")
        self.drafter = drafter
        self.dtype = numpy_dtype(manifest.dtype)
        self.vocab_size = manifest.dims.vocab_size
        self.all_logits = manifest.all_logits
        graph = opened.directory / manifest.graphs["prefill"].file
        options = session_options(intra_op_threads, spinning=spinning)
        if cuda_graph:
            require_capture(opened.provider, graph)
        self.session = open_session(graph, opened.provider, options, cuda_graph=cuda_graph, paged=paged)
        self.cuda_graph, self.static_decode = cuda_graph, static_decode
        # prompt pieces on a capturing session run neither captured nor replayed
        self._uncaptured = graph_run_options(NO_CAPTURE) if cuda_graph else None
        self._fixed: dict[int, FixedDecode] = {}  # rows -> the fixed decode call (cuda_graph, static_decode)
        self._graph_ids = GraphIds()
        self.mixed_session: ort.InferenceSession | None = None
        self.unmixed_because = "" if mixed else "not asked for"  # why there is no mixed session
        if mixed:
            try:  # a graph the split can't take (MixedStepError), or no onnx_ir here: separate calls, as before
                self.mixed_session = open_mixed_session(
                    graph, opened.provider, session_options(intra_op_threads, spinning=spinning), all_logits=self.all_logits, paged=paged
                )
            except (KvexportError, ValueError, ImportError) as exc:
                self.unmixed_because = f"{type(exc).__name__}: {first_line(exc)}"
        self.bf16_decode_rows = bf16_decode_rows  # decode calls of at least this many rows run through the prompt session (0: none)
        self.prompt_session: ort.InferenceSession | None = None
        self.prompt_products = "not asked for"  # the prompt session's kernel path, or why there is none
        if prompt_products:
            options = session_options(intra_op_threads, spinning=spinning)
            self.prompt_session, self.prompt_products = prompt_session_for(
                graph, opened.provider, options, self.vocab_size, paged=paged
            )
        self.cache: SlotCache = (
            PagedCache(pool_manifest(manifest, pool_dtype), opened.provider, slots, capacity, paged_blocks)
            if paged_blocks is not None
            else SlotCache(manifest, opened.provider, slots, capacity)
        )
        # decode-step inputs and logits, one row per slot; a binding views their first rows
        self._ids = np.zeros((slots, 1), np.int64)
        self._positions = np.zeros((slots, 1), np.int64)
        self._mask = np.zeros((slots, capacity), np.int64)
        self._logits = np.zeros((slots, 1, self.vocab_size), self.dtype)
        self._bindings: dict[tuple[int, int, bool], ort.IOBinding] = {}  # (id of the session, rows, gathered) -> its decode binding
        # the paged cache's table rows of a call's chosen slots (decode with ``slots``), bound by address
        self._gathered_tables = np.zeros_like(self.cache.tables) if isinstance(self.cache, PagedCache) else np.zeros((0, 0), np.int32)
        self._mixed_bindings: dict[tuple[int, int], ort.IOBinding] = {}

    def execute(self, plan: CallPlan, *, sampling: tuple[SamplingConfig, np.random.Generator] | None = None) -> ModelOutput:
        """Run one step's plan: the admitted requests' row copies, then its call.

        ``sampling``: a speculative round's request's settings and random stream. A prefix
        that fails to run is reported (``error``), not raised: only its own pinned rows are
        harmed, never a running request's.
        """
        if plan.start is not None:
            for _, placement in plan.start.admitted:
                if isinstance(self.cache, PagedCache):
                    self.cache.copy_blocks(placement.block_copies)
                elif placement.copy_from is not None:
                    self.copy_rows(placement.copy_from, placement.slot, placement.reused)
        call, output = plan.call, ModelOutput()
        started = time.perf_counter()
        if isinstance(call, PrefixJob):
            try:
                self.run_piece(call.slot, call.tokens, 0)
            except Exception as exc:
                output.error = f"{type(exc).__name__}: {first_line(exc)[:300]}"
        elif isinstance(call, PrefillChunk):
            output.prompt = [self._prompt_piece(call)]
        elif isinstance(call, PrefillBatch):
            output.prompt = list(self.run_rows(call.first, [chunk.tokens for chunk in call.chunks], call.start))
        elif isinstance(call, MixedCall):
            chunk, decode = call.chunk, call.decode
            prompt, output.decode = self.mixed(chunk.request.slot, chunk.tokens, chunk.start, decode.tokens, decode.positions)
            output.prompt = [prompt]
        elif isinstance(call, DecodePlan):
            output.decode = self.decode(call.tokens, call.positions, call.slots)
        elif isinstance(call, SpeculativePlan):
            self._speculate(call, output, sampling)
        output.seconds = time.perf_counter() - started
        return output

    def _prompt_piece(self, chunk: PrefillChunk) -> np.ndarray:
        """A prompt chunk's logits; a lone token after a cached past runs with the one before it.

        A call of one token a row takes the decode path's attention, which sums in another order
        than a prompt's: the prompt's last token after a reused prefix (the prefix cache leaves at
        least that one) gave logits up to 0.6 away from the same prompt's in one call (SmolLM2-135M,
        int8 blocks and bf16 prompts alike), and greedy tokens that parted from the Generator's.
        Two tokens run the prompt path, and the row before is rewritten with what it holds.
        """
        request, start = chunk.request, chunk.start
        if len(chunk.tokens) == 1 and start > 0:
            return self.run_piece(request.slot, [request.context[start - 1], *chunk.tokens], start - 1)[-1:]
        return self.run_piece(request.slot, chunk.tokens, start)

    def _speculate(
        self, plan: SpeculativePlan, output: ModelOutput, sampling: tuple[SamplingConfig, np.random.Generator] | None
    ) -> None:
        """One request alone: draft tokens, verify them in one call; the kept ones and the next are its tokens."""
        if self.drafter is None or sampling is None:
            raise RuntimeError("a speculative round needs the runner's drafter and the request's sampling")
        request = plan.request
        slot, start = request.slot, request.length

        def run(piece: Sequence[int]) -> np.ndarray:  # the decoding session: drafts are judged by the decode path's numbers
            return self.cache.run_piece(self.session, slot, piece, start, self._uncaptured)

        drafts, kept, following = speculative_round(self.drafter, plan.budget, plan.context, plan.room, run, *sampling)
        output.drafts, output.kept, output.accepted = list(drafts), kept, [*drafts[:kept], following]

    def shrink_arenas(self) -> None:
        """Give back what ONNX Runtime's CPU arenas hold past one small call (after the warm-up's large ones).

        One token at slot 0's position 0 through each session, with the arena shrinking at the
        run's end; slot 0's first row is written (the warm-up's rows are forgotten anyway).
        """
        if self.cache.banks.device != "cpu":
            return
        options = ort.RunOptions()
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        for session in (self.session, self.prompt_session):  # the mixed step's, off by default, keeps its arena
            if session is not None:
                self.cache.run_piece(session, 0, [0], 0, options)

    @property
    def can_copy_rows(self) -> bool:
        """Whether rows can be copied between slots here (CPU buffers; paged: shared by blocks, never copied)."""
        return self.cache.can_copy_rows

    def copy_rows(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` rows of slot ``source`` into slot ``target``."""
        self.cache.copy_rows(source, target, length)

    def run_piece(self, slot: int, piece: Sequence[int], start: int) -> np.ndarray:
        """A prompt's ``piece`` at batch 1 after the ``start`` tokens cached in ``slot``; its logits [n or 1, V] (fp32).

        It runs by the prompt session where there is one (a speculative round's pieces do not: :meth:`_speculate`).
        """
        session = self.prompt_session if self.prompt_session is not None else self.session
        return self.cache.run_piece(session, slot, piece, start, self._uncaptured)

    @property
    def can_batch_prompts(self) -> bool:
        """Whether fresh prompts' first pieces may share one call (:meth:`run_rows`): CPU (unmeasured on CUDA)."""
        return self.cache.banks.device == "cpu"

    @property
    def can_batch_after_past(self) -> bool:
        """Whether pieces after a past of one length may share one call too (``run_rows`` with a ``start``).

        Where every attention of the session's graph runs such a call as the CPU products
        (an 8-bit cache's; :class:`kvexport.passes.PromptAttentionPass` marks the graph):
        ``GroupQueryAttention`` itself refuses new tokens over a past at batch > 1.
        """
        metadata = self.session.get_modelmeta().custom_metadata_map
        return self.can_batch_prompts and metadata.get(ROWS_AFTER_PAST) == "products"

    def run_rows(self, first: int, pieces: Sequence[Sequence[int]], start: int = 0) -> np.ndarray:
        """Pieces all one length into slots ``first..``, each after the ``start`` tokens its slot holds, in one call.

        ``start`` 0: fresh prompts' first pieces; later pieces where :attr:`can_batch_after_past`.
        Returns the logits [rows, n or 1, V] (fp32). They run by the prompt session where there is one.
        """
        session = self.prompt_session if self.prompt_session is not None else self.session
        return self.cache.run_rows(session, first, pieces, start, self._uncaptured)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int] | None = None) -> np.ndarray:
        """One call over slots ``0..len(tokens)-1``: row i feeds ``tokens[i]`` at ``positions[i]``.

        ``slots`` (the paged cache): row i is slot ``slots[i]``'s instead, its table row gathered
        into the call's (no row runs for a slot that does not decode). Returns the logits
        [rows, V] in the session's dtype: a view, valid until the next call.
        """
        rows = len(tokens)
        self._set_decode_rows(tokens, positions)
        if slots is not None:
            if not isinstance(self.cache, PagedCache):
                raise ValueError("decode rows of chosen slots read a paged cache's tables; this runner's cache is in slots")
            np.take(self.cache.tables, slots, axis=0, out=self._gathered_tables[:rows])
        if self.cuda_graph or self.static_decode:
            logits = self._fixed_decode(rows).run(self._ids[:rows], self._mask[:rows], self._positions[:rows])
            return logits[:, 0, :]
        session = self.session
        if self.prompt_session is not None and 0 < self.bf16_decode_rows <= rows:
            session = self.prompt_session
        session.run_with_iobinding(self._decode_binding(session, rows, gathered=slots is not None))
        return self._logits[:rows, 0, :]

    def _fixed_decode(self, rows: int) -> FixedDecode:
        """The fixed decode call of the first ``rows`` slots, made once per row count (its own ``gpu_graph_id`` with ``cuda_graph``)."""
        fixed = self._fixed.get(rows)
        if fixed is None:
            graph_id = self._graph_ids(rows, self.cache.row_shape[1]) if self.cuda_graph else None
            fixed = self._fixed[rows] = FixedDecode(self.session, self.cache, rows, graph_id)
        return fixed

    def mixed(
        self, slot: int, piece: Sequence[int], start: int, tokens: Sequence[int], positions: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """One call: ``piece`` into ``slot`` after its ``start`` cached tokens, and a decode step over slots ``0..len(tokens)-1``.

        The decode rows are as :meth:`decode`'s; a row that is not running (``slot`` among
        them) must be fed a position that ``piece`` does not write. Returns the piece's
        logits ([n or 1, V], fp32, as :meth:`run_piece`) and the decode rows' ([rows, V],
        the session's dtype).
        """
        if self.mixed_session is None:
            raise RuntimeError(f"this runner has no mixed step ({self.unmixed_because})")
        rows = len(tokens)
        if not rows:  # GroupQueryAttention at batch 0 kills the process (ONNX Runtime 1.31)
            raise ValueError("a mixed call needs at least one decode row; run the piece alone")
        self._set_decode_rows(tokens, positions)
        binding = self._mixed_bindings.get((slot, rows))
        if binding is None:  # the caches and the decode mask stay bound; each call rebinds the packed inputs and the logits
            binding = self._mixed_bindings[(slot, rows)] = self.mixed_session.io_binding()
            self.cache.bind(binding, slot, 1)
            self.cache.bind(binding, 0, rows, prefix=DECODE_PREFIX)
            binding.bind_input(f"{DECODE_PREFIX}attention_mask", "cpu", 0, np.int64, [rows, self._mask.shape[1]], self._mask.ctypes.data)
        end = start + len(piece)
        binding.bind_cpu_input("input_ids", np.array([[*piece, *tokens]], np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, end), np.int64))
        binding.bind_cpu_input("position_ids", np.array([[*range(start, end), *positions]], np.int64))
        count = len(piece) + rows if self.all_logits else 1 + rows
        shape = [1, count, self.vocab_size] if self.all_logits else [count, 1, self.vocab_size]  # see mixed_step
        logits = np.empty((count, self.vocab_size), self.dtype)
        binding.bind_output("logits", "cpu", 0, self.dtype, shape, logits.ctypes.data)
        self.mixed_session.run_with_iobinding(binding)
        return logits[: count - rows].astype(np.float32), logits[count - rows :]

    def _set_decode_rows(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        rows = len(tokens)
        self._ids[:rows, 0] = tokens
        self._positions[:rows, 0] = positions
        self._mask[:rows] = 0
        for row, position in enumerate(positions):
            self._mask[row, : position + 1] = 1

    def _decode_binding(self, session: ort.InferenceSession, rows: int, *, gathered: bool = False) -> ort.IOBinding:
        """``session``'s binding of the first ``rows`` slots (``gathered``: of the gathered table's rows), made once per session, row count and kind, and kept."""
        key = (id(session), rows, gathered)
        binding = self._bindings.get(key)
        if binding is not None:
            return binding
        binding = session.io_binding()
        for name, array in (("input_ids", self._ids), ("position_ids", self._positions), ("attention_mask", self._mask)):
            binding.bind_input(name, "cpu", 0, np.int64, [rows, *array.shape[1:]], array.ctypes.data)
        binding.bind_output("logits", "cpu", 0, self.dtype, [rows, 1, self.vocab_size], self._logits.ctypes.data)
        if gathered and isinstance(self.cache, PagedCache):
            self.cache.bind(binding, 0, rows, table=self._gathered_tables[:rows])
        else:
            self.cache.bind(binding, 0, rows)
        self._bindings[key] = binding
        return binding
