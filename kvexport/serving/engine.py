"""``Engine``: many requests at once over one in-place cache (continuous batching).

An in-place export (``--target ort-cpu`` / ``ort-cuda``) takes each row's length from the
mask's *values*: a row's ``seqlens_k`` is the index of its last 1. So one call can hold
rows of different lengths, and the engine keeps one cache of ``[slots, H, capacity, D]``
per tensor, allocated once on the session's device. A request owns a slot (a row) from
its admission until it finishes.

One thread runs the loop; each iteration

- admits waiting requests into free slots, reusing any cached prefix of the prompt (below);
- prefills up to ``chunk`` prompt tokens (default 256), the oldest admitted prompts first,
  each at batch 1 straight into its slot's region of the buffer (bound by address, no
  copy), so prompts that arrive together get their first tokens sooner, and a long prompt
  holds up the running streams for one chunk at most;
- runs **one** call for every running row: each row its own token, position and mask row
  (ones up to its own length), over a mask as wide as the capacity. The binding for a
  given number of rows is made once and kept, so shapes and addresses stay the same from
  step to step; rows up to the highest running slot take part (free or still-prefilling
  slots in between write one harmless row where their next real row will go);
- samples each row with its own settings, streams each request its tokens, and frees a
  slot the step its request finishes or is cancelled.

**Prefix cache.** A slot's rows stay valid after its request ends, and the engine keeps,
per slot, the tokens they hold. A new prompt that starts with tokens cached in some slot
reuses those rows and prefills only the rest (at batch 1 with past, as a chunk does):
in place when the slot holding them is free and as cheap a place as any, else copied
into the slot it gets (CPU; on CUDA only in place). Slots are handed out so the decode
rows stay few: a free slot below the highest running one, least recently used first,
else the lowest free one. :meth:`Engine.register_prefix` keeps a prompt's rows in a slot
of their own (the highest free one) until :meth:`Engine.unregister_prefix`. Reused rows
hold what a prefill of the same tokens would write, so the cache does not change a
request's output.

The prefill graph of an in-place export serves both phases, so the engine opens one
ONNX Runtime session, whose intra-op threads may spin between runs without a second
session's pool fighting them for the cores.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from kvexport.errors import KvexportError, first_line
from kvexport.integrity import preflight
from kvexport.runtime.generator import SlotCache, numpy_dtype
from kvexport.runtime.sampling import SamplingConfig, choose_tokens
from kvexport.runtime.session import open_session, resolve_provider, session_options
from kvexport.runtime.speculative import (
    DEFAULT_DRAFT_TOKENS,
    DraftBudget,
    Drafter,
    common_prefix,
    require_all_logits,
    speculative_round,
)
from kvexport.runtime.text import ExportTokenizer, TextStream

DEFAULT_CHUNK = 256
# A cached prefix shorter than this is not worth copying from another slot
MIN_COPIED_PREFIX = 16


class EngineFull(KvexportError):
    """The engine's queue of waiting requests is full; try again later."""


class EngineClosed(KvexportError):
    """The engine is shutting down and takes no new requests."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's settings, with the OpenAI completions API's meanings.

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable those filters;
    ``stop`` ends the text before the first stop string it would contain; EOS ends it
    unless ``ignore_eos``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def sampling(self) -> SamplingConfig:
        """The runtime's sampling settings (greedy for temperature 0)."""
        if self.temperature == 0:
            return SamplingConfig(do_sample=False)
        return SamplingConfig(True, self.temperature, self.top_k, self.top_p, self.seed)

    def validate(self) -> None:
        """One line for an out-of-range setting."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise KvexportError(f"max_tokens {self.max_tokens!r}: must be a positive integer")
        if self.temperature < 0:
            raise KvexportError(f"temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise KvexportError(f"top_k {self.top_k}: must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise KvexportError(f"top_p {self.top_p}: must be in (0, 1] (1 disables it)")
        if any(not s for s in self.stop):
            raise KvexportError("stop: an empty stop string would stop at once; leave it out")


@dataclass(frozen=True)
class TokenEvent:
    """What a request's stream yields: a token (or the end) and the text it adds.

    ``text`` may be empty while a multi-byte character or a possible stop string is not
    complete yet; it is released later. The last event has a ``finish_reason``: ``stop``
    (EOS or a stop string), ``length`` (``max_tokens``), ``cancelled`` or ``error``.
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None


class EngineListener(Protocol):
    """What the engine reports as it runs (the HTTP app feeds Prometheus from it)."""

    def on_first_token(self, seconds: float) -> None:
        """Time from submission to a request's first token."""

    def on_token(self, seconds: float) -> None:
        """Time between two tokens of one request."""

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended."""


class RequestHandle:
    """One submitted request: iterate it (``for`` or ``async for``) for its :class:`TokenEvent` s.

    Thread-safe. :meth:`cancel` ends it within one engine step and frees its slot.
    """

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.id = request_id
        self.prompt = prompt
        self.params = params
        self.submitted = time.perf_counter()
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens whose rows came from the prefix cache
        self.finish_reason: str | None = None
        self.pin = False  # a prefix to keep (register_prefix), not a completion
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._cancelled = threading.Event()

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt)

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop generating; the stream ends with ``finish_reason="cancelled"`` (if it had not ended)."""
        self._cancelled.set()

    def _push(self, event: TokenEvent) -> None:
        """Called by the engine thread."""
        with self._lock:
            self._events.append(event)
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
            self._ready.notify_all()
            waker = self._waker
        if waker is not None:
            loop, ready = waker
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            with self._lock:
                while not self._events:
                    self._ready.wait()
                event = self._events.popleft()
            yield event
            if event.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        ready = asyncio.Event()
        with self._lock:
            self._waker = (asyncio.get_running_loop(), ready)
        while True:
            with self._lock:
                event = self._events.popleft() if self._events else None
                if event is None:
                    ready.clear()
            if event is None:
                await ready.wait()
                continue
            yield event
            if event.finish_reason is not None:
                return

    def result(self) -> tuple[list[int], str, str]:
        """Wait for the end: (token ids, text, finish reason)."""
        tokens, pieces, reason = [], [], ""
        for event in self:
            if event.token_id is not None:
                tokens.append(event.token_id)
            pieces.append(event.text)
            reason = event.finish_reason or reason
        return tokens, "".join(pieces), reason


@dataclass
class _Sequence:
    """A request in a slot: its progress through the prompt, then through generation."""

    handle: RequestHandle
    slot: int
    sampling: SamplingConfig
    rng: np.random.Generator
    text: TextStream
    prefilled: int = 0  # prompt tokens in the cache so far
    length: int = 0  # tokens in the cache
    next_token: int = 0  # the token the next decode step feeds
    generated: int = 0
    last_time: float = 0.0
    running: bool = False  # prompt done, decoding
    draft_budget: DraftBudget | None = None  # speculative decoding, while it runs alone


@dataclass
class _Resident:
    """What a slot's cache rows hold: the tokens of its first rows, valid after its request ends."""

    tokens: list[int] = field(default_factory=list)
    used: float = 0.0  # when they were last written or reused
    pinned: bool = False  # a registered prefix: never handed to a request


@dataclass
class EngineStats:
    """A snapshot of the engine's state (``/metrics`` and tests read it).

    ``prompt_tokens`` counts the prompt tokens prefilled; ``cached_tokens`` those reused
    from the prefix cache instead, over ``prefix_hits`` requests; ``pinned`` the slots
    kept for registered prefixes; ``drafted_tokens`` / ``accepted_tokens`` the speculative
    drafts proposed and kept.
    """

    slots: int
    slots_in_use: int
    running: int
    waiting: int
    prefilling: int
    steps: int
    prompt_tokens: int
    generated_tokens: int
    prefix_hits: int = 0
    cached_tokens: int = 0
    pinned: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Engine:
    """Serve many requests at once over one in-place cache (see the module docstring).

    Args:
        directory: an export with the in-place cache (``--target ort-cpu`` / ``ort-cuda``,
            or ``--cache shared-buffer``).
        slots: rows of the cache: requests generating at once.
        max_context: tokens per slot (prompt + completion); default the model's positions.
        max_queue: requests that may wait for a slot; more are refused (:class:`EngineFull`).
        chunk: prompt tokens prefilled per loop iteration.
        provider: ``cpu``, ``cuda`` or ``auto``.
        intra_op_threads: ONNX Runtime threads (default: ONNX Runtime's choice).
        spinning: let the session's threads spin between runs (faster decode steps on CPU;
            the engine has one session, so no second pool competes with them).
        check: compare every file's size and sha256 with the manifest before loading.
        listener: told of first tokens, inter-token times and finishes (metrics).
        prefix_cache: reuse the cached rows of a prompt's prefix (see the module docstring).
        drafter: speculative decoding while one request runs alone (a
            :class:`~kvexport.runtime.speculative.PromptLookup` or ``DraftModel``); the
            export needs ``--all-logits``.
        draft_tokens: drafts per speculative step.

    """

    def __init__(
        self,
        directory: str | Path,
        *,
        slots: int = 8,
        max_context: int | None = None,
        max_queue: int = 64,
        chunk: int = DEFAULT_CHUNK,
        provider: str = "cpu",
        intra_op_threads: int | None = None,
        spinning: bool = True,
        check: bool = False,
        listener: EngineListener | None = None,
        prefix_cache: bool = True,
        drafter: Drafter | None = None,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    ) -> None:
        self.directory = Path(directory)
        found = preflight(self.directory, hash_files=check)
        found.raise_first()
        self.manifest = manifest = found.manifest
        if manifest.cache_layout != "shared-buffer":
            raise KvexportError(
                f"{self.directory}: has the {manifest.cache_layout} cache layout; the engine needs the in-place "
                "cache: export with --target ort-cpu or ort-cuda (or --cache shared-buffer)"
            )
        dims = manifest.dims
        self.capacity = dims.n_positions if max_context is None else max_context
        for name, value, low in (("slots", slots, 1), ("max_queue", max_queue, 0), ("chunk", chunk, 1)):
            if value < low:
                raise KvexportError(f"{name} {value}: must be at least {low}")
        if not 2 <= self.capacity <= dims.n_positions:
            raise KvexportError(f"max_context {self.capacity}: must be 2..{dims.n_positions} (the model's positions)")
        self.slots, self.max_queue, self.chunk = slots, max_queue, chunk
        self.provider = resolve_provider(provider)
        self.dtype = numpy_dtype(manifest.dtype)
        self.vocab_size = dims.vocab_size
        self.eos_token_id: int | None = manifest.tokenizer.get("eos_token_id")
        self._tokenizer = ExportTokenizer(self.directory, manifest)
        self.tokenizer: Tokenizer | None = self._tokenizer.tokenizer
        options = session_options(intra_op_threads, spinning=spinning)
        self.session = open_session(self.directory / manifest.graphs["prefill"].file, self.provider, options)
        self._cache = SlotCache(manifest, self.provider, slots, self.capacity)
        self.prefix_cache = prefix_cache
        if drafter is not None:
            require_all_logits(self.directory, manifest)
        self.drafter, self.draft_tokens = drafter, draft_tokens
        self._residents = [_Resident() for _ in range(slots)]
        # decode-step inputs and logits, one row per slot; a binding views their first rows
        self._ids = np.zeros((slots, 1), np.int64)
        self._positions = np.zeros((slots, 1), np.int64)
        self._mask = np.zeros((slots, self.capacity), np.int64)
        self._logits = np.zeros((slots, 1, self.vocab_size), self.dtype)
        self._bindings: dict[int, ort.IOBinding] = {}
        self._listeners: list[EngineListener] = [listener] if listener is not None else []
        self._ids_counter = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._active: dict[int, _Sequence] = {}  # slot -> sequence
        self._closing = False
        self._counters = dict.fromkeys(
            ("steps", "prompt_tokens", "generated_tokens", "prefix_hits", "cached_tokens", "drafted_tokens", "accepted_tokens"), 0
        )
        self._finished: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name="kvexport-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- requests

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the export's tokenizer."""
        return self._tokenizer.encode(text)

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> RequestHandle:
        """Queue a request (text or token ids); iterate the returned handle for its tokens.

        Raises :class:`KvexportError` for a bad prompt or settings (one line),
        :class:`EngineFull` when ``max_queue`` requests already wait, and
        :class:`EngineClosed` once :meth:`close` has begun.
        """
        params = params or SamplingParams()
        params.validate()
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_prompt(ids, params)
        return self._enqueue(RequestHandle(f"cmpl-{next(self._ids_counter)}", ids, params))

    def _enqueue(self, handle: RequestHandle) -> RequestHandle:
        with self._lock:
            if self._closing:
                raise EngineClosed("the server is shutting down; send the request to another replica")
            free = self.slots - len(self._active) - self._pinned()
            if len(self._waiting) >= self.max_queue + max(0, free):
                raise EngineFull(f"{len(self._waiting)} requests are waiting for a slot; retry shortly")
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    def register_prefix(self, prefix: str | Sequence[int]) -> int:
        """Keep the cache rows of ``prefix`` in a slot of their own; returns its length in tokens.

        Requests whose prompts start with it then prefill only the rest (the rows are copied
        into their slots, so this needs the CPU provider). The slot stays taken, one fewer
        for requests, until :meth:`unregister_prefix`. Blocks until the prefix is cached.
        """
        if not self.prefix_cache or not self._cache.can_copy_rows:
            raise KvexportError("registered prefixes need the prefix cache on the CPU provider")
        ids = self.encode(prefix) if isinstance(prefix, str) else [int(t) for t in prefix]
        self._check_prompt(ids, SamplingParams(max_tokens=1))
        with self._lock:
            if self._pinned() >= self.slots - 1:
                raise KvexportError(f"all but one of the {self.slots} slots hold registered prefixes; unregister one first")
        handle = RequestHandle(f"prefix-{next(self._ids_counter)}", ids, SamplingParams(max_tokens=1))
        handle.pin = True
        _, _, reason = self._enqueue(handle).result()
        if reason != "pinned":
            raise KvexportError(f"the prefix was not cached ({reason})")
        return len(ids)

    def _pinned(self) -> int:
        """Slots kept for registered prefixes (caller holds the lock)."""
        return sum(r.pinned for r in self._residents)

    def unregister_prefix(self, prefix: str | Sequence[int]) -> bool:
        """Free the slot kept for ``prefix`` (its rows stay cached until reused); False if none was."""
        ids = self.encode(prefix) if isinstance(prefix, str) else [int(t) for t in prefix]
        with self._lock:
            for resident in self._residents:
                if resident.pinned and resident.tokens == ids:
                    resident.pinned = False
                    return True
        return False

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise KvexportError("the prompt is empty; pass at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise KvexportError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(ids) + params.max_tokens > self.capacity:
            raise KvexportError(
                f"this model's maximum context length is {self.capacity} tokens, but {len(ids) + params.max_tokens} "
                f"were requested ({len(ids)} in the prompt, {params.max_tokens} for the completion); "
                "shorten the prompt or ask for fewer tokens"
            )

    def add_listener(self, listener: EngineListener) -> None:
        """Also tell ``listener`` of first tokens, inter-token times and finishes."""
        self._listeners.append(listener)

    def stats(self) -> EngineStats:
        """What the engine holds and has done so far."""
        with self._lock:
            prefilling = sum(not s.running for s in self._active.values())
            return EngineStats(
                slots=self.slots,
                slots_in_use=len(self._active),
                running=len(self._active) - prefilling,
                waiting=len(self._waiting),
                prefilling=prefilling,
                steps=self._counters["steps"],
                prompt_tokens=self._counters["prompt_tokens"],
                generated_tokens=self._counters["generated_tokens"],
                prefix_hits=self._counters["prefix_hits"],
                cached_tokens=self._counters["cached_tokens"],
                pinned=self._pinned(),
                drafted_tokens=self._counters["drafted_tokens"],
                accepted_tokens=self._counters["accepted_tokens"],
                finished=dict(self._finished),
            )

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; finish the admitted and waiting ones (``drain``) or cancel them; stop the loop."""
        with self._lock:
            self._closing = True
            if not drain:
                for handle in [*self._waiting, *(s.handle for s in self._active.values())]:
                    handle.cancel()
            self._wake.notify()
        self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(drain=False)

    # ---------------------------------------------------------------- loop

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._active and not self._closing:
                    self._wake.wait()
                if self._closing and not self._waiting and not self._active:
                    return
                self._admit()
            self._drop_cancelled()
            try:
                self._prefill()
                self._decode_step()
            except Exception as exc:  # a failed run ends the requests it held, not the engine
                self._fail_all(exc)

    def _admit(self) -> None:
        """Waiting requests into free slots, with their cached prefixes (caller holds the lock)."""
        free = [slot for slot in range(self.slots) if slot not in self._active and not self._residents[slot].pinned]
        while self._waiting and free:
            handle = self._waiting.popleft()
            if handle.cancelled:
                self._finish_unadmitted(handle)
                continue
            slot, reused = self._place(handle, free)
            free.remove(slot)
            self._residents[slot].tokens = handle.prompt[:reused]
            self._residents[slot].used = time.perf_counter()
            handle.cached_tokens = reused
            if reused:
                self._counters["prefix_hits"] += 1
                self._counters["cached_tokens"] += reused
            params = handle.params
            self._active[slot] = _Sequence(
                handle=handle,
                slot=slot,
                sampling=params.sampling(),
                rng=np.random.default_rng(params.seed),
                text=TextStream(self.tokenizer, params.stop),
                prefilled=reused,
                length=reused,
            )

    def _place(self, handle: RequestHandle, free: list[int]) -> tuple[int, int]:
        """The slot for a request and how many prompt tokens of it are cached there (copied if need be).

        At least the prompt's last token is left to prefill: its logits give the first token.
        """
        if handle.pin:  # a registered prefix: out of the way of the decode rows
            return max(free), 0
        rows = max(self._active, default=-1) + 1
        below = [slot for slot in free if slot < rows]
        target = min(below, key=lambda slot: self._residents[slot].used) if below else min(free)
        if not self.prefix_cache:
            return target, 0
        limit = len(handle.prompt) - 1
        matches = [(common_prefix(r.tokens, handle.prompt, limit), slot) for slot, r in enumerate(self._residents)]
        best, source = max(matches, key=lambda match: (match[0], match[1] in free))
        own = matches[target][0]
        if best > own and source in free and (source < rows or source <= target):
            return source, best  # in place, and no more decode rows than the target
        if best > own and best >= MIN_COPIED_PREFIX and self._cache.can_copy_rows:
            self._cache.copy_rows(source, target, best)
            self._residents[source].used = time.perf_counter()
            return target, best
        return target, own

    def _finish_unadmitted(self, handle: RequestHandle) -> None:
        handle._push(TokenEvent(None, "", "cancelled"))
        self._finished["cancelled"] += 1
        for listener in self._listeners:
            listener.on_finish("cancelled", handle.prompt_tokens, 0)

    def _drop_cancelled(self) -> None:
        for sequence in list(self._active.values()):
            if sequence.handle.cancelled:
                self._finish(sequence, "cancelled")

    def _prefill(self) -> None:
        """Up to ``chunk`` prompt tokens this iteration: the oldest admitted prompts first, each at batch 1."""
        budget = self.chunk
        for sequence in sorted((s for s in self._active.values() if not s.running), key=lambda s: s.handle.submitted):
            if budget == 0:
                return
            budget -= self._prefill_chunk(sequence, budget)

    def _prefill_chunk(self, sequence: _Sequence, budget: int) -> int:
        """The next ``budget`` tokens (at most) of one prompt, at batch 1, into its slot's rows; how many."""
        prompt = sequence.handle.prompt
        start = sequence.prefilled
        piece = prompt[start : start + budget]
        logits = self._run_piece(sequence.slot, piece, start)
        end = sequence.prefilled = sequence.length = start + len(piece)
        with self._lock:
            self._counters["prompt_tokens"] += len(piece)
        if end == len(prompt) and sequence.handle.pin:
            with self._lock:
                self._residents[sequence.slot].pinned = True
                self._active.pop(sequence.slot)
            sequence.handle._push(TokenEvent(None, "", "pinned"))
        elif end == len(prompt):
            sequence.running = True
            token = int(choose_tokens(logits[-1:], sequence.sampling, sequence.rng)[0])
            self._emit(sequence, token, first=True)
        return len(piece)

    def _run_piece(self, slot: int, piece: Sequence[int], start: int) -> np.ndarray:
        """``piece`` at batch 1 after the ``start`` tokens cached in ``slot``; its logits [n or 1, V] (fp32)."""
        logits = self._cache.run_piece(self.session, slot, piece, start)
        resident = self._residents[slot]
        del resident.tokens[start:]
        resident.tokens.extend(piece)
        return logits

    def _speculative_step(self, sequence: _Sequence) -> None:
        """One request alone: draft tokens, verify them in one call, stream the kept ones and the next."""
        assert self.drafter is not None
        resident = self._residents[sequence.slot]
        pending = sequence.next_token
        params = sequence.handle.params
        budget = sequence.draft_budget = sequence.draft_budget or DraftBudget(self.draft_tokens)
        room = min(params.max_tokens - sequence.generated - 1, self.capacity - sequence.length - 1)
        start = sequence.length
        drafts, kept, following = speculative_round(
            self.drafter,
            budget,
            [*resident.tokens, pending],
            room,
            lambda piece: self._run_piece(sequence.slot, piece, start),
            sequence.sampling,
            sequence.rng,
        )
        del resident.tokens[sequence.length + 1 + kept :]  # the rejected drafts' rows are free again
        sequence.length = len(resident.tokens)
        with self._lock:
            self._counters["steps"] += 1
            self._counters["drafted_tokens"] += len(drafts)
            self._counters["accepted_tokens"] += kept
        for token in [*drafts[:kept], following]:
            self._emit(sequence, token)
            if sequence.handle.finish_reason is not None:
                return

    def _decode_binding(self, rows: int) -> ort.IOBinding:
        """The binding of the first ``rows`` slots, made once per row count and kept."""
        binding = self._bindings.get(rows)
        if binding is not None:
            return binding
        binding = self.session.io_binding()
        for name, array in (("input_ids", self._ids), ("position_ids", self._positions), ("attention_mask", self._mask)):
            binding.bind_input(name, "cpu", 0, np.int64, [rows, *array.shape[1:]], array.ctypes.data)
        binding.bind_output("logits", "cpu", 0, self.dtype, [rows, 1, self.vocab_size], self._logits.ctypes.data)
        self._cache.bind(binding, 0, rows)
        self._bindings[rows] = binding
        return binding

    def _decode_step(self) -> None:
        """One call for every running row; each row samples and streams its next token."""
        running = [s for s in self._active.values() if s.running]
        if not running:
            return
        if self.drafter is not None and len(self._active) == 1 and not self._waiting:
            self._speculative_step(running[0])
            return
        rows = max(s.slot for s in running) + 1
        self._mask[:rows] = 0
        for slot in range(rows):
            sequence = self._active.get(slot)
            resident = self._residents[slot]
            if sequence is not None and sequence.running:
                self._ids[slot, 0] = sequence.next_token
                self._positions[slot, 0] = sequence.length
                self._mask[slot, : sequence.length + 1] = 1
                resident.tokens.append(sequence.next_token)
            else:  # a free or prefilling slot writes one row just past the rows it keeps
                del resident.tokens[self.capacity - 1 :]
                cached = len(resident.tokens)
                self._ids[slot, 0] = 0
                self._positions[slot, 0] = cached
                self._mask[slot, : cached + 1] = 1
        self.session.run_with_iobinding(self._decode_binding(rows))
        with self._lock:
            self._counters["steps"] += 1
        for sequence in running:
            sequence.length += 1
        greedy = [s for s in running if not s.sampling.do_sample]
        if greedy:
            slots = [s.slot for s in greedy]
            tokens = self._logits[slots, 0, :].argmax(-1)
            for sequence, token in zip(greedy, tokens, strict=True):
                self._emit(sequence, int(token))
        for sequence in running:
            if sequence.sampling.do_sample:
                row = self._logits[sequence.slot : sequence.slot + 1, 0, :].astype(np.float32)
                self._emit(sequence, int(choose_tokens(row, sequence.sampling, sequence.rng)[0]))

    def _emit(self, sequence: _Sequence, token: int, first: bool = False) -> None:
        """Stream a sampled token (or end at EOS, a stop string or max_tokens)."""
        handle = sequence.handle
        now = time.perf_counter()
        for listener in self._listeners:
            if first:
                listener.on_first_token(now - handle.submitted)
            else:
                listener.on_token(now - sequence.last_time)
        sequence.last_time = now
        sequence.generated += 1
        handle.completion_tokens = sequence.generated
        with self._lock:
            self._counters["generated_tokens"] += 1
        if token == self.eos_token_id and not handle.params.ignore_eos:
            handle._push(TokenEvent(token, sequence.text.flush(), "stop"))
            self._release(sequence, "stop")
            return
        text, stopped = sequence.text.add(token)
        if stopped:
            handle._push(TokenEvent(token, text, "stop"))
            self._release(sequence, "stop")
            return
        if sequence.generated >= handle.params.max_tokens:
            handle._push(TokenEvent(token, text + sequence.text.flush(), "length"))
            self._release(sequence, "length")
            return
        handle._push(TokenEvent(token, text))
        sequence.next_token = token

    def _finish(self, sequence: _Sequence, reason: str, error: str | None = None) -> None:
        sequence.handle._push(TokenEvent(None, "", reason, error))
        self._release(sequence, reason)

    def _release(self, sequence: _Sequence, reason: str) -> None:
        with self._lock:
            self._active.pop(sequence.slot, None)
            self._finished[reason] += 1
            resident = self._residents[sequence.slot]
            resident.used = time.perf_counter()
            if reason == "error":  # a failed run may have left the rows half written
                resident.tokens.clear()
        for listener in self._listeners:
            listener.on_finish(reason, sequence.handle.prompt_tokens, sequence.generated)

    def _fail_all(self, exc: Exception) -> None:
        message = f"{type(exc).__name__}: {first_line(exc)[:300]}"
        for sequence in list(self._active.values()):
            self._finish(sequence, "error", message)
