"""``Engine``: many requests at once over one in-place cache (continuous batching).

An in-place export (``--target ort-cpu`` / ``ort-cuda``) takes each row's length from the
mask's *values*: a row's ``seqlens_k`` is the index of its last 1. So one call can hold
rows of different lengths. A request owns a slot (a row) from its admission until it
finishes. On CPU with an fp32 cache (``EngineConfig.kv_layout`` ``auto``) the cache is a pool
of 16-token blocks read through a block table (:class:`~kvexport.runtime.cache.PagedCache`,
:class:`~kvexport.serving.blocks.BlockManager`): a slot holds blocks as its request fills
them, so memory follows the tokens in use, a reused prefix's blocks are shared, and when the
pool runs out the request admitted last is preempted and recomputed. Elsewhere the engine
keeps one cache of ``[slots, H, capacity, D]`` per tensor, allocated once on the session's
device.

The engine is four parts, as vLLM v1 splits it, tied together by one thread's loop:

- the :class:`~kvexport.serving.scheduler.Scheduler` (plain Python): the queue,
  admission, slot placement and the prefill token budget, with the cache's bookkeeping
  in a :class:`~kvexport.serving.slots.SlotTable` (what each slot holds, prefix matching,
  pinning, LRU order); it owns each request's engine state
  (:class:`~kvexport.serving.request.Request`);
- the :class:`~kvexport.serving.runner.ModelRunner`: the session, the slot buffers and
  the bindings; it runs the plan's calls and returns logits;
- the :class:`~kvexport.serving.output.OutputProcessor`: logits processors, sampling,
  log-probabilities, stops, text and stream events; it owns each request's client side
  (:class:`~kvexport.serving.output.RequestState`, what :meth:`Engine.submit` returns).

One step, as vLLM v1's ``EngineCore.step``, runs one model call: the scheduler plans it
(:meth:`~kvexport.serving.scheduler.Scheduler.next_call`, a
:class:`~kvexport.serving.scheduler.CallPlan`), the runner executes it and returns its
logits (:meth:`~kvexport.serving.runner.ModelRunner.execute`), the output processor turns
them into tokens and returns an :class:`~kvexport.serving.output.OutputBatch` (which
requests took which tokens, which ended and why), and the scheduler updates from both
(:meth:`~kvexport.serving.scheduler.Scheduler.update_from_output`) before the events go
to the callers. Each part returns data; only the scheduler changes request and cache
state, and only the step thread touches the scheduler: callers' requests, prefixes, and
``close`` reach it through an input queue it drains between steps (vLLM's ``EngineCore``
input queue), so the step path takes no lock. A caller judges the queue's bound against
what the step thread last published (waiting requests and free slots) plus what it has sent
since (:meth:`Engine._enqueue`).

The scheduler plans in rounds: a round admits waiting requests into free slots, reusing
any cached prefix of the prompt, and prefills prompt tokens, the oldest admitted prompts
first, each at batch 1 straight into its slot in pieces of at most ``chunk``: up to 4096
while no more streams run than prompts wait, else as many as keep the round within twice
the slowest recent decode step (or ``step_ms``), see
:class:`~kvexport.serving.scheduler.PrefillBudget`; then **one** decode call over every
running row ends it. While one request runs alone, an engine with a drafter decodes it
speculatively instead.

**Prefix cache.** A slot's rows stay valid after its request ends; a new prompt that
starts with tokens cached in some slot reuses those rows and prefills only the rest: in
place when that slot is free, else copied into the slot it gets (CPU; on CUDA only in
place). :meth:`Engine.register_prefix` keeps a prompt's rows in a slot of their own.
Reused rows hold what a prefill of the same tokens would write, so the cache does not
change a request's output.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tokenizers import Tokenizer

from kvexport.bundle.manifest import Manifest
from kvexport.errors import KvexportError, ManifestError, first_line
from kvexport.passes.vocabulary import PAGE_TOKENS
from kvexport.runtime.cache import cache_row_bytes, pool_manifest
from kvexport.runtime.kernels import library_path
from kvexport.runtime.opened import OpenedExport, check_prompt, open_export
from kvexport.runtime.speculative import Drafter, require_all_logits
from kvexport.serving.blocks import BlockManager, blocks_for
from kvexport.serving.config import EngineConfig
from kvexport.serving.errors import ParameterError
from kvexport.serving.output import OutputBatch, OutputProcessor, RequestState
from kvexport.serving.request import Request, SamplingParams
from kvexport.serving.runner import ModelOutput, ModelRunner
from kvexport.serving.scheduler import (
    CallPlan,
    EngineFull,
    EngineStats,
    PrefillBudget,
    PrefixJob,
    Scheduler,
    SpeculativePlan,
)
from kvexport.serving.slots import SlotTable

__all__ = [
    "DEFAULT_KV_MEMORY", "DEFAULT_POOL_MEMORY", "Engine", "EngineClosed", "EngineFull", "EngineListener", "EngineStats", "default_capacity",
    "pool_blocks", "slot_bytes", "slots_for_memory",
]

# The cache's size where neither --max-context nor --kv-memory says it (default_capacity): 1 GiB. Every
# slot at the model's full context took 8 x 8,192 tokens, 2.81 GiB of fp32 cache, for SmolLM2-135M (a
# 135M model) and 8 x 32,768, 12 GiB, for Qwen2.5-0.5B, and `kvexport serve` minutes to start. 1 GiB
# keeps GPT-2's whole context on 8 slots and gives the small Llama-style models 2-5k tokens a slot
# (llama-server's default, -c 4096, is shared by all its slots).
DEFAULT_KV_MEMORY = 1 << 30
# The paged cache's pool where --kv-memory does not say it: 4 GiB, what vLLM's CPU backend set aside for its
# KV cache on the same 24 GiB host (its log: "Explicitly set (4.0/23.54) GiB for KV cache"). It is reserved,
# not touched: blocks take memory as requests first fill them (SmolLM2-135M: 64 requests of 640 tokens need
# 1.77 GiB; the 1 GiB the slots share held 1,455 blocks of 16 and preempted at that load).
DEFAULT_POOL_MEMORY = 4 << 30
MIN_DEFAULT_CONTEXT = 512  # the least a slot gets by default, whatever the budget says (a large model's cache)


def slot_bytes(manifest: Manifest, capacity: int) -> int:
    """Bytes of cache one slot of ``capacity`` tokens holds, in the export's cache dtype (every layer, K and V)."""
    return 2 * manifest.dims.num_layers * cache_row_bytes(manifest, capacity)


def default_capacity(manifest: Manifest, slots: int) -> int:
    """Tokens per slot where neither ``max_context`` nor ``kv_memory`` is given: what fits :data:`DEFAULT_KV_MEMORY`.

    As many tokens as ``slots`` slots hold in :data:`DEFAULT_KV_MEMORY` bytes of cache, rounded
    down to a multiple of 256, at least :data:`MIN_DEFAULT_CONTEXT` and at most the model's positions.
    """
    per_token = slot_bytes(manifest, 1)
    fits = DEFAULT_KV_MEMORY // (slots * per_token) // 256 * 256
    return min(manifest.dims.max_positions, max(MIN_DEFAULT_CONTEXT, fits))


def slots_for_memory(manifest: Manifest, capacity: int, budget: int) -> int:
    """How many slots of ``capacity`` tokens ``budget`` bytes of cache hold; one line if not even one."""
    per_slot = slot_bytes(manifest, capacity)
    if budget < per_slot:
        raise KvexportError(
            f"kv_memory {budget} bytes holds no slot: one slot of {capacity} tokens takes {per_slot} bytes of "
            f"{manifest.cache_dtype} cache; give more, or a smaller max_context"
        )
    return budget // per_slot


PAGED_CONTEXT = 8192  # the paged cache's default context, at most: a decode call's mask is as wide
# blocks a pool needs beside one request's: the spare block, and one a shared prefix's partly valid block is copied into
_BLOCKS_BESIDE = 2


def paged_capacity(manifest: Manifest, budget: int) -> int:
    """Tokens a request may hold by default over a paged pool of ``budget`` bytes.

    The model's positions, at most :data:`PAGED_CONTEXT` and what one request can take of the pool.
    """
    whole = (budget // slot_bytes(manifest, PAGE_TOKENS) - _BLOCKS_BESIDE) * PAGE_TOKENS
    return max(2, min(manifest.dims.max_positions, PAGED_CONTEXT, whole))


def pool_blocks(manifest: Manifest, budget: int, capacity: int) -> int:
    """Blocks of the paged cache that ``budget`` bytes hold (the spare one among them); one line if one request of ``capacity`` tokens does not fit."""
    blocks = budget // slot_bytes(manifest, PAGE_TOKENS)
    needed = blocks_for(capacity) + _BLOCKS_BESIDE
    if blocks < needed:
        raise KvexportError(
            f"kv_memory {budget} bytes holds {blocks} blocks of {PAGE_TOKENS} tokens ({slot_bytes(manifest, PAGE_TOKENS)} bytes each "
            f"of {manifest.cache_dtype} cache); one request of max_context {capacity} tokens needs {needed}: give more "
            "--kv-memory, or a smaller --max-context"
        )
    return blocks


def why_not_paged(config: EngineConfig, opened: OpenedExport) -> str | None:
    """Why the engine keeps the slot layout for ``opened`` under ``config`` (None: it pages the cache)."""
    if config.kv_layout == "slots":
        return "--kv-layout slots"
    if opened.provider != "cpu":
        return "not on CPU"
    if config.cuda_graph or config.static_decode:
        return "a fixed-address decode call (--cuda-graph, --static-decode)"
    if opened.manifest.cache_dtype != "fp32":
        return f"an {opened.manifest.cache_dtype} cache, which ONNX Runtime's attention reads"
    if library_path() is None:
        return "kvexport's kernels are not built (kvexport build-kernels)"
    return None


def pool_dtype(config: EngineConfig, manifest: Manifest, unpaged: str | None) -> str:
    """What the cache holds under ``config``: the paged pool's element type, or over slots the export's own cache dtype.

    ``auto`` over the paged cache: fp16 for an export with quantized weights (on the real SmolLM2-135M int8, fp16
    keys and values moved perplexity by -0.004% from fp32's, where the int8 blocks move it +0.2-0.4%), the
    export's fp32 for a float export (its numbers stay fp32's, as ``verify`` proves them). A dtype the slot
    layout can't hold is refused in one line.
    """
    choice = config.kv_cache_dtype
    if unpaged is None:
        if choice != "auto":
            return choice
        return "fp16" if manifest.quantization is not None else manifest.cache_dtype
    if choice not in ("auto", manifest.cache_dtype):
        raise KvexportError(
            f"--kv-cache-dtype {choice}: the cache stays in slots here ({unpaged}), which hold the export's own "
            f"{manifest.cache_dtype} cache; use --kv-cache-dtype auto"
        )
    return manifest.cache_dtype


class EngineClosed(KvexportError):
    """The engine is shutting down and takes no new requests."""


class EngineListener(Protocol):
    """What the engine reports as it runs (the HTTP app feeds Prometheus from it)."""

    def on_first_token(self, seconds: float) -> None:
        """Time from submission to a request's first token."""

    def on_token(self, seconds: float) -> None:
        """Time between two tokens of one request."""

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended."""


@dataclass
class _Step:
    """A step that ran: its plan, what the runner gave, and what the output processor made of it."""

    plan: CallPlan
    ran: ModelOutput
    outputs: OutputBatch


_T = TypeVar("_T")

ALL_LOGITS_BYTES = 256 << 20  # an --all-logits graph's shared prefill call returns at most this many bytes of logits


def all_logits_tokens(chunk: int, vocab_size: int) -> int:
    """The most tokens of a shared prefill call of an ``--all-logits`` graph: fp32 logits for each, within :data:`ALL_LOGITS_BYTES` (at least ``chunk``)."""
    return max(chunk, ALL_LOGITS_BYTES // (4 * vocab_size))


class Engine:
    """Serve many requests at once over one in-place cache (see the module docstring).

    Args:
        directory: an export with the in-place cache (``--target ort-cpu`` / ``ort-cuda``,
            or ``--cache shared-buffer``).
        config: every setting (:class:`~kvexport.serving.config.EngineConfig`); keyword
            ``settings`` override its fields (``Engine(dir, slots=4)``).
        listener: told of first tokens, inter-token times and finishes (metrics).
        drafter: a drafter object for speculative decoding, instead of the one the config
            names (a :class:`~kvexport.runtime.speculative.PromptLookup` or ``DraftModel``).

    """

    def __init__(
        self,
        directory: str | Path,
        config: EngineConfig | None = None,
        *,
        listener: EngineListener | None = None,
        drafter: Drafter | None = None,
        **settings: Any,
    ) -> None:
        config = (config or EngineConfig()).updated(**settings)
        self.config = config
        opened = open_export(directory, config.provider, check=config.check)
        opened.require_in_place("the engine needs the in-place cache")
        self.directory, self.manifest, self.provider = opened.directory, opened.manifest, opened.provider
        dims = self.manifest.dims
        unpaged = why_not_paged(config, opened)
        pool_memory = config.kv_memory or DEFAULT_POOL_MEMORY
        if unpaged is not None and config.kv_layout == "paged":
            raise KvexportError(f"--kv-layout paged: no paged cache here ({unpaged}); use --kv-layout auto or slots")
        self.cache_dtype = pool_dtype(config, self.manifest, unpaged)
        pooled = pool_manifest(self.manifest, self.cache_dtype) if unpaged is None else self.manifest  # what a block holds
        if config.max_context is not None:
            self.capacity = config.max_context
        elif unpaged is None:
            self.capacity = paged_capacity(pooled, pool_memory)
        elif config.kv_memory is not None:
            self.capacity = dims.max_positions
        else:
            self.capacity = default_capacity(self.manifest, config.slots)
        if not 2 <= self.capacity <= dims.max_positions:
            raise KvexportError(f"max_context {self.capacity}: must be 2..{dims.max_positions} (the model's positions)")
        blocks = None if unpaged is not None else pool_blocks(pooled, pool_memory, self.capacity)
        if blocks is None and config.kv_memory is not None:
            config = self.config = config.updated(slots=slots_for_memory(self.manifest, self.capacity, config.kv_memory))
        self.slots, self.max_queue, self.chunk = config.slots, config.max_queue, config.chunk
        self.prefix_cache = config.prefix_cache
        self.vocab_size = dims.vocab_size
        self.eos_token_id = opened.eos_token_id
        self._tokenizer = opened.tokenizer
        self.tokenizer: Tokenizer | None = self._tokenizer.tokenizer
        self.drafter = drafter if drafter is not None else config.drafter()
        if self.drafter is not None:
            require_all_logits(self.directory, self.manifest)
        self.draft_tokens = config.draft_tokens
        try:
            self.runner = self._runner(opened, blocks)
        except ManifestError as exc:  # a graph the kernel can't page (auto: the slot layout then)
            if blocks is None or config.kv_layout == "paged":
                raise
            unpaged, blocks = first_line(exc), None
            self.cache_dtype = pool_dtype(config, self.manifest, unpaged)
            self.runner = self._runner(opened, None)
        self.kv_layout = "paged" if blocks is not None else f"slots ({unpaged})"
        manager = BlockManager(blocks, self.runner.cache.tables) if blocks is not None else None  # type: ignore[attr-defined]
        self.table = SlotTable(
            config.slots, prefix_cache=config.prefix_cache, can_copy_rows=self.runner.can_copy_rows, blocks=manager
        )
        self.scheduler = Scheduler(
            self.table,
            budget=PrefillBudget(config.chunk, target_ms=config.step_ms),
            max_queue=config.max_queue,
            capacity=self.capacity,
            draft_tokens=config.draft_tokens,
            batch_prompts=config.batch_prompts and self.runner.can_batch_prompts,
            batch_after_past=config.batch_prompts and self.runner.can_batch_after_past,
            batch_tokens=min(config.batch_tokens, all_logits_tokens(config.chunk, dims.vocab_size))
            if self.manifest.all_logits
            else config.batch_tokens,
            mixed=self.runner.mixed_session is not None,
            speculate=self.drafter is not None,
        )
        self.output = OutputProcessor(self.tokenizer, opened.eos_token_ids, self.vocab_size)
        self._listeners: list[EngineListener] = []
        self._ids_counter = itertools.count()
        # callers -> the step thread: commands it runs between steps (vLLM's EngineCore input queue)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._sending = threading.Lock()  # callers' only: one sender at a time judges the bound (the step thread never takes it)
        self._taken = 0  # requests the step thread has taken out of the inbox
        # the step thread's last word, one tuple: (taken, the requests waiting for a slot, free slots)
        self._room: tuple[int, tuple[Request, ...], int] = (0, (), self.scheduler.request_slots)
        self._in_flight: collections.deque[Request] = collections.deque()  # callers': sent, not yet taken (after _dropped)
        self._dropped = 0  # callers': requests dropped from the front of _in_flight, once taken
        self._stats = self.scheduler.stats()  # and its last stats
        self._closing = False  # set by close(), under _sending: nothing is sent after the close command
        self._stopping = False  # set by the step thread when it runs the close command
        if config.warm_up:  # in this thread, before the loop's starts: a warm-up that fails leaves no thread behind
            self._warm_up(config.warm_up)
        self._thread = threading.Thread(target=self._loop, name="kvexport-engine", daemon=True)
        self._thread.start()
        if listener is not None:
            self._listeners.append(listener)

    def _runner(self, opened: OpenedExport, blocks: int | None) -> ModelRunner:
        config = self.config
        return ModelRunner(
            opened,
            config.slots,
            self.capacity,
            intra_op_threads=config.intra_op_threads,
            spinning=config.spinning,
            mixed=config.mixed_step and self.provider == "cpu",
            drafter=self.drafter,
            cuda_graph=config.cuda_graph,
            static_decode=config.static_decode,
            prompt_products=config.prompt_products == "auto",
            paged_blocks=blocks,
            pool_dtype=self.cache_dtype,
            bf16_decode_rows=config.bf16_decode_rows,
        )

    # ---------------------------------------------------------------- requests

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the export's tokenizer."""
        return self._tokenizer.encode(text)

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> RequestState:
        """Queue a request (text or token ids); iterate the returned request for its tokens.

        Raises :class:`KvexportError` for a bad prompt or settings (one line; a
        :class:`~kvexport.serving.errors.ParameterError` names the field),
        :class:`EngineFull` when ``max_queue`` requests already wait, and
        :class:`EngineClosed` once :meth:`close` has begun.
        """
        return self.submit_n(prompt, params or SamplingParams(), 1)[0]

    def submit_n(self, prompt: str | Sequence[int], params: SamplingParams, n: int) -> list[RequestState]:
        """Queue ``n`` samples of one prompt, prefilled once (the others copy its rows where they can).

        Sample i draws with ``seed + i`` when ``params.seed`` is set, as vLLM's children
        do; only the first computes ``prompt_logprobs``, into a list all of them share.
        """
        return self.submit_all([(prompt, params)], n)

    def submit_all(self, prompts: Sequence[tuple[str | Sequence[int], SamplingParams]], n: int = 1) -> list[RequestState]:
        """Queue ``n`` samples of each (prompt, params) pair at once, all or none; their states in order, ``n`` a prompt.

        Each prompt is as :meth:`submit_n`'s. Queued together, the prompts reach one step
        of the scheduler together, whose fresh first pieces can then share a call
        (``EngineConfig.batch_prompts``); one bad prompt refuses them all, before any runs.
        """
        checked = [(self._checked(prompt, params), params) for prompt, params in prompts]
        if n < 1:
            raise ParameterError(f"n {n}: must be at least 1", parameter="n")
        if n > 1 and any(params.temperature == 0 for _, params in checked):  # vLLM's rule: n greedy choices would all be the same
            raise ParameterError(f"n {n}: must be 1 when using greedy sampling (temperature 0)", parameter="n")
        self.check_fits(len(prompts) * n)
        requests: list[Request] = []
        states: list[RequestState] = []
        for ids, params in checked:
            self._children(ids, params, n, requests, states)
        self._enqueue(requests, states)
        return states

    def _children(self, ids: list[int], params: SamplingParams, n: int, requests: list[Request], states: list[RequestState]) -> None:
        """Append the ``n`` requests (and states) of one prompt: the first prefills it, the others follow."""
        start = len(requests)
        children = [params] + [
            dataclasses.replace(params, seed=None if params.seed is None else params.seed + index, prompt_logprobs=None)
            for index in range(1, n)
        ]
        for child in children:
            request_id, cancelled = f"cmpl-{next(self._ids_counter)}", threading.Event()
            first = requests[start] if len(requests) > start else None
            requests.append(Request(request_id, ids, child, after=first, cancelled=cancelled))
            shared = states[start].prompt_logprobs if len(states) > start else None  # the same prompt: filled once, by the first
            states.append(RequestState(request_id, ids, child, cancelled=cancelled, prompt_logprobs=shared))

    def _enqueue(self, requests: list[Request], states: list[RequestState], *, bounded: bool = True) -> None:
        """Send the requests to the step thread, all or none: :class:`EngineFull` where the queue's bound refuses them.

        The bound is the scheduler's (``max_queue`` waiting beyond the free slots), judged against the
        step thread's last word (:attr:`_room`) plus the requests sent since, which it has not taken yet;
        a request its caller cancelled counts no more, at once (the step thread drops it at its next round).
        ``bounded`` False: past the bound too (the warm-up).
        """
        for state in states:  # in the caller's thread: a grammar's matcher takes milliseconds
            self.output.prepare(state)
        with self._sending:
            if self._closing:
                raise EngineClosed("the server is shutting down; send the request to another replica")
            taken, queued, free = self._room
            for _ in range(taken - self._dropped):
                self._in_flight.popleft()
            self._dropped = taken
            waiting = sum(not request.cancelled for request in (*queued, *self._in_flight))
            limit = self.max_queue + max(0, free)
            if bounded and waiting + len(requests) > limit:
                raise EngineFull(f"{max(waiting, limit)} requests are waiting for a slot; retry shortly")
            self._in_flight.extend(requests)
            self._inbox.put(lambda: self._add(requests, states))

    def _add(self, requests: list[Request], states: list[RequestState]) -> None:
        """On the step thread: the requests to the scheduler, their streams to the output processor."""
        self._taken += len(requests)
        self.scheduler.add_all(requests, bounded=False)  # the sender judged the bound
        for state in states:
            self.output.add_request(state)

    def _call(self, command: Callable[[], _T]) -> _T:
        """Run ``command`` on the step thread, between steps, and return what it returns (or raise what it raises).

        The step thread publishes its word (:meth:`_publish_room`: the stats too) before the caller resumes, so
        what the caller reads next already holds the command's effect, whether the engine was busy or idle.
        """
        future: Future[_T] = Future()

        def run() -> None:
            try:
                result = command()
            except Exception as exc:
                future.set_exception(exc)
                return
            self._publish_room()
            future.set_result(result)

        with self._sending:
            if self._closing:
                raise EngineClosed("the server is shutting down; send the request to another replica")
            self._inbox.put(run)
        return future.result()

    def _drain(self, timeout: float | None = 0.0) -> None:
        """On the step thread: run what callers sent, waiting up to ``timeout`` seconds for the first (None: until one comes).

        The requests it takes still count in the senders' bound as sent (:attr:`_in_flight`) until the
        step thread's next word (:meth:`_publish_room`, once the step's plan is made).
        """
        try:
            command = self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break

    def _publish_room(self) -> None:
        """On the step thread: what callers judge the queue's bound and read the stats from, each one assignment."""
        scheduler = self.scheduler
        self._room = (self._taken, tuple(scheduler.waiting), scheduler.request_slots - len(scheduler.active))
        self._stats = scheduler.stats()

    def check_fits(self, requests: int) -> None:
        """Refuse ``requests`` sent together that could never all be queued (a 503 would never clear)."""
        self.scheduler.check_fits(requests)  # reads the slots and the pinned count: ints the step thread writes whole

    def _checked(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        params.validate(self.vocab_size, self.config.max_logprobs)
        if params.stop and self.tokenizer is None:
            raise ParameterError(
                f"stop: {self.directory} has no tokenizer, so there is no text to find stop strings in; use stop_token_ids",
                parameter="stop",
            )
        if params.prompt_logprobs is not None and not self.manifest.all_logits:
            raise ParameterError(
                f"prompt logprobs need the logits at every prompt position, and {self.directory.name}'s prefill graph "
                "returns the last position's only; serve an export made with --all-logits",
                parameter="prompt_logprobs",
            )
        if params.structured is not None:  # the grammar compiles here, in the caller's thread, never the engine's
            self.output.check_structured(params.structured)
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        check_prompt(ids, self.vocab_size, params.max_tokens, self.capacity)
        return ids

    def register_prefix(self, prefix: str | Sequence[int]) -> int:
        """Keep the cache rows of ``prefix`` in a slot of their own; returns its length in tokens.

        Requests whose prompts start with it then prefill only the rest (the rows are copied
        into their slots, so this needs the CPU provider). The slot stays taken, one fewer
        for requests, until :meth:`unregister_prefix`. Blocks until the prefix is cached.
        """
        if not self.prefix_cache or not self.table.can_copy_rows:
            raise KvexportError("registered prefixes need the prefix cache on the CPU provider")
        ids = self.encode(prefix) if isinstance(prefix, str) else [int(t) for t in prefix]
        check_prompt(ids, self.vocab_size, 1, self.capacity)
        job = PrefixJob(ids)
        self._call(lambda: self.scheduler.add_prefix(job))
        job.done.wait()
        if job.error is not None:
            raise KvexportError(f"the prefix was not cached ({job.error})")
        return len(ids)

    def unregister_prefix(self, prefix: str | Sequence[int]) -> bool:
        """Free the slot kept for ``prefix`` (its rows stay cached until reused); False if none was."""
        ids = self.encode(prefix) if isinstance(prefix, str) else [int(t) for t in prefix]
        return self._call(lambda: self.scheduler.unpin(ids))

    def add_listener(self, listener: EngineListener) -> None:
        """Also tell ``listener`` of first tokens, inter-token times and finishes."""
        self._listeners.append(listener)

    def stats(self) -> EngineStats:
        """What the engine holds and has done so far, as the step thread last published it (after each step, before its events)."""
        return self._stats

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; finish the admitted and waiting ones (``drain``) or cancel them; stop the loop."""

        def stop() -> None:
            self._stopping = True
            if not drain:
                for request in self.scheduler:
                    request.cancel()

        with self._sending:
            if not self._closing:
                self._closing = True
                self._inbox.put(stop)
        self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(drain=False)

    def _warm_up(self, count: int) -> None:
        """Run one request alone, then one on every slot (at least ``count``) together, then forget them: counters, finishes and cached rows.

        Alone, a prompt runs at batch 1; together, their first pieces (``chunk`` tokens, or
        half a slot) share a call (``batch_prompts``): both kinds of call, the shared one at the
        size of a full burst's, have run once before the first client's. A first burst pays
        for ONNX Runtime's first run at a size (memory it allocates and touches): sixteen
        128-token prompts to GPT-2 on 2 cores got their first tokens after 834 ms when the
        warm-up shared a call of two prompts, 472 ms after this one (443-488 ms later on).

        Runs in the constructor's thread, before the loop's starts (:meth:`_run_until_idle`);
        a call that fails raises here, in one line.
        """
        length = max(1, min(self.chunk, self.capacity // 2))
        new = max(1, min(8, self.capacity - length))
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        together = max(count, self.slots)
        prompts = [[(7 * i + j) % self.vocab_size for j in range(length)] for i in range(together + 1)]
        cancels = [threading.Event() for _ in prompts]
        requests = [Request(f"warm-up-{i}", prompt, params, cancelled=cancels[i]) for i, prompt in enumerate(prompts)]
        states = [RequestState(r.id, r.prompt, params, cancelled=cancels[i]) for i, r in enumerate(requests)]
        for group in (slice(0, 1), slice(1, None)):
            self._enqueue(requests[group], states[group], bounded=False)
            try:
                self._run_until_idle()
            except Exception as exc:
                raise KvexportError(
                    f"the engine's warm-up failed: {type(exc).__name__}: {first_line(exc)[:300]} (is {self.directory} a whole, "
                    "unchanged export? kvexport check tells)"
                ) from exc
            for state in states[group]:
                state.result()
        self.scheduler.forget()
        self.runner.shrink_arenas()
        self.runner.cache.banks.release_memory()  # the rows it wrote are forgotten: their pages go back
        self._publish_room()

    # ---------------------------------------------------------------- loop

    def _loop(self) -> None:
        """The engine's thread: one step after another, until :meth:`close` and nothing is left."""
        done: _Step | None = None
        while True:
            plan: CallPlan | None = None
            try:  # between steps: the last step's outputs in, what callers sent in, this step's plan out
                if done is None:
                    while self.scheduler.idle and not self._stopping:
                        self._drain(timeout=None)
                    self._drain()
                    plan = self._plan()
                else:
                    self.scheduler.update_from_output(done.plan, done.ran, done.outputs)
                    self._drain()
                    if not self.scheduler.at_rest:  # at rest, a burst may be gathered: its callers hear first
                        plan = self._plan()
                self._publish_room()
            except Exception as exc:  # a plan that could not be made: the queue ends too
                if done is not None:
                    self._publish_or_fail(done)
                self._fail(exc, waiting=True)
                done = None
                continue
            if done is not None:
                self._publish_or_fail(done)
                if plan is None:  # idle, or at rest: the next turn waits, or gathers and plans
                    done = None
                    continue
            elif plan is None:  # idle, and closing
                return
            done = self._run(plan)

    def _run_until_idle(self) -> None:
        """Step in this thread until nothing is left (the warm-up, before the loop's thread starts); a failed step raises."""
        done: _Step | None = None
        while True:
            if done is not None:
                self.scheduler.update_from_output(done.plan, done.ran, done.outputs)
            self._drain()
            plan = self._plan()
            self._publish_room()
            if done is not None:
                self._publish(done)
            if plan is None and done is None:
                return
            done = self._step(plan) if plan is not None else None

    def _plan(self) -> CallPlan | None:
        """On the step thread: the scheduler's next plan (None: nothing to do); a burst may be gathered first."""
        for _ in range(2):  # a round that ended with no call: the next one starts now
            if self.scheduler.idle:
                return None
            if self.scheduler.at_rest:  # a burst may be starting
                self._gather()
            plan = self.scheduler.next_call()
            if plan is not None:
                return plan
        return None

    def _gather(self) -> None:
        """On the step thread, requests waiting and none admitted: let the rest of a burst arrive (``gather_ms``).

        Waits while requests keep coming less than ``gather_ms`` apart, at most ten times
        that in all, and no longer once they fill the free slots: then one step admits them
        together and their first pieces share calls.
        """
        gap = self.config.gather_ms / 1000 if self.scheduler.batch_prompts else 0.0
        deadline = time.monotonic() + 10 * gap
        seen = self.scheduler.queued
        while gap and not self._closing and seen < self.scheduler.request_slots:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._drain(timeout=min(gap, left))
            if self.scheduler.queued == seen:  # none came within the gap
                return
            seen = self.scheduler.queued

    def _run(self, plan: CallPlan) -> _Step | None:
        """:meth:`_step`, where a failed run ends the requests it held, not the engine."""
        try:
            return self._step(plan)
        except Exception as exc:
            self._fail(exc, plan=plan)
            return None

    def _publish_or_fail(self, step: _Step) -> None:
        """:meth:`_publish`, where a listener that raises ends the requests held with its error, not the engine's thread."""
        try:
            self._publish(step)
        except Exception as exc:
            self._fail(exc)

    def _step(self, plan: CallPlan) -> _Step:
        """Execute ``plan`` (the runner) and turn its logits into tokens and events (the output processor); both return data."""
        call = plan.call
        sampling = self.output.sampling_of(call.request.id) if isinstance(call, SpeculativePlan) else None
        ran = self.runner.execute(plan, sampling=sampling)
        return _Step(plan, ran, self._outputs(plan, ran))

    def _outputs(self, plan: CallPlan, ran: ModelOutput) -> OutputBatch:
        """The output processor's part of a step: tokens and events from the logits ``ran`` holds.

        The round's cancelled requests end; each prompt chunk's logits give its prompt
        log-probabilities and, the prompt's last, its first token; the decode rows give their
        next tokens, a speculative round its kept drafts and the next.
        """
        outputs = OutputBatch()
        if plan.start is not None:
            outputs.extend(self.output.abort([r.id for r in plan.start.dropped + plan.start.cancelled], "cancelled"))
            for request, placement in plan.start.admitted:
                self.output.admitted(request.id, placement.reused)
        for chunk, logits in zip(plan.chunks, ran.prompt, strict=True):
            if chunk.request.resume is not None:  # recomputed after a preemption: its next token is pending already
                continue
            if self.runner.all_logits:
                self.output.prompt_logprobs(chunk.request.id, logits, chunk.start)
            if chunk.last:
                outputs.extend(self.output.first_token(chunk.request.id, logits[-1]))
        decode = plan.decode
        if decode is not None and ran.decode is not None:
            outputs.extend(self.output.decoded([r.id for r in decode.requests], ran.decode, decode.request_rows))
        if isinstance(plan.call, SpeculativePlan):
            outputs.extend(self.output.accepted(plan.call.request.id, ran.accepted))
        return outputs

    def _publish(self, step: _Step) -> None:
        """Tell the listeners, then give the callers their events (a cached prefix: its waiter)."""
        outputs = step.outputs
        try:
            for listener in self._listeners:
                for seconds in outputs.first_token_s:
                    listener.on_first_token(seconds)
                for seconds in outputs.token_s:
                    listener.on_token(seconds)
                for finished in outputs.finished:
                    listener.on_finish(finished.reason, finished.prompt_tokens, finished.completion_tokens)
        finally:  # the callers get their events even if a listener fails
            self.output.publish(outputs)
            job = step.plan.call
            if isinstance(job, PrefixJob):
                job.error = step.ran.error
                job.done.set()

    def _fail(self, exc: Exception, *, waiting: bool = False, plan: CallPlan | None = None) -> None:
        """End every admitted request (and the waiting ones too, when ``waiting``) with the error; the round's prefixes not cached are given up.

        ``plan``: the call that failed; a prefix it was caching is given up too (the round no longer holds it).
        """
        message = f"{type(exc).__name__}: {first_line(exc)[:300]}"
        failed = [r.id for r in self.scheduler.unfinished(waiting=waiting)]
        abandoned = self.scheduler.end_round()
        job = plan.call if plan is not None else None
        if isinstance(job, PrefixJob) and not job.done.is_set():
            self.scheduler.prefix_failed(job)
            abandoned.append(job)
        step = _Step(CallPlan(), ModelOutput(), self.output.abort(failed, "error", message))
        self.scheduler.update_from_output(step.plan, None, step.outputs)
        self._publish_room()
        try:
            self._publish(step)
        finally:
            for job in abandoned:
                job.error = message
                job.done.set()
