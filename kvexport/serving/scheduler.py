"""The scheduler: the queue, admission, slot placement and the prefill token budget.

Plain Python (no ONNX Runtime, onnx or torch). A round of calls starts with a
:class:`StepPlan` (:meth:`Scheduler.schedule`: which requests enter which slots, which
prefixes to pin, which prompt chunks to prefill, which requests were cancelled) and ends
with its :class:`DecodePlan` (one batched call over every running row, or a speculative
round for a request running alone), planned once the prompt chunks have run. The engine
asks for one :class:`CallPlan` a step (:meth:`Scheduler.next_call`: the round's next
call), has it run, and hands back what it gave (:meth:`Scheduler.update_from_output`).
The scheduler alone changes the requests' state (:class:`~kvexport.serving.request.Request`),
the cache's bookkeeping (:class:`~kvexport.serving.slots.SlotTable`) and the counts
:meth:`Scheduler.stats` reports: from its plans, and from those outputs.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from kvexport.drafting import DEFAULT_DRAFT_TOKENS, DraftBudget
from kvexport.errors import KvexportError
from kvexport.serving.blocks import BlockManager
from kvexport.serving.errors import ParameterError
from kvexport.serving.request import Request, Status
from kvexport.serving.slots import MIN_COPIED_PREFIX, Placement, SlotTable


class EngineFull(KvexportError):
    """The engine's queue of waiting requests is full; try again later."""


BURST_TOKENS = 4096  # prompt tokens one step may prefill while no stream runs (vLLM's CPU budget is of this order)
MIN_STEP_TOKENS = 16  # while streams run, a step still prefills this many, so a prompt always advances
CALL_COST = 16  # a call's own cost, in prompt tokens: what batching must gain for each call it adds
_SMOOTHING = 0.2  # weight of the newest measurement in the running averages
_PEAK_DECAY = 0.995  # per decode step: a peak from a full batch fades over a few hundred steps


class PrefillBudget:
    """How many prompt tokens one step prefills: the running streams' next token against the waiting prompts' first.

    A step prefills its prompt chunks, then decodes every running row; the chunks' time is
    added to every running stream's gap between two tokens. So:

    - while no more streams run than prompts wait to be prefilled (a burst, or a wave of
      requests that replaces the ones that ended), up to ``burst`` tokens: those prompts get
      their first tokens before decode steps hold them up, and the few running streams wait;
    - while more streams run, as many as keep the step (chunks and decode) within ``target_ms``,
      at the measured costs: by default twice the slowest recent decode step, so a stream's
      gap stays within about twice what a full batch's decode takes, and a step with few
      streams running (cheap decodes) prefills more. At least ``floor`` and at most
      ``chunk`` tokens; ``chunk`` until the costs are measured.

    ``chunk`` also bounds each call (one request's piece). Plain Python: the engine reports
    each prefill and decode call's time (:meth:`prefilled`, :meth:`decoded`).
    """

    def __init__(self, chunk: int, *, burst: int = BURST_TOKENS, target_ms: float | None = None, floor: int = MIN_STEP_TOKENS) -> None:
        self.chunk, self.burst, self.target_ms, self.floor = chunk, max(burst, chunk), target_ms, min(floor, chunk)
        self.forget()

    def forget(self) -> None:
        """Drop the measured costs (the engine's warm-up: ONNX Runtime's cold first runs are no guide)."""
        self.seconds_per_token: float | None = None
        self.decode_seconds: float | None = None
        self.decode_peak = 0.0  # the slowest recent decode step (decays slowly)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """One prefill call of ``tokens`` took ``seconds``."""
        if tokens >= self.floor:  # a short piece's cost is mostly the call's, not its tokens'
            self.seconds_per_token = _smoothed(self.seconds_per_token, seconds / tokens)

    def mixed(self, tokens: int, seconds: float) -> None:
        """One mixed call of ``tokens`` prompt tokens and the decode rows took ``seconds``.

        The rows' share is taken as the last decode call's time, an upper bound (inside the
        chunk's GEMMs they cost less), so the prompt tokens' cost errs low and the next
        steps' chunks long, never short; nothing is learnt before a decode call is measured.
        """
        if self.decode_seconds is not None and seconds > self.decode_seconds:
            self.prefilled(tokens, seconds - self.decode_seconds)

    def decoded(self, seconds: float) -> None:
        """One decode call over the running rows took ``seconds``."""
        self.decode_seconds = _smoothed(self.decode_seconds, seconds)
        self.decode_peak = max(self.decode_seconds, self.decode_peak * _PEAK_DECAY)

    def tokens(self, *, running: int, prefilling: int) -> int:
        """The step's prompt tokens, with ``running`` streams and ``prefilling`` prompts not done: ``burst`` unless more streams run, else what fits the target."""
        if running <= prefilling:
            return self.burst
        if self.decode_seconds is None or self.seconds_per_token is None:
            return self.chunk
        target = self.target_ms / 1000 if self.target_ms is not None else 2 * self.decode_peak
        return max(self.floor, min(self.chunk, round((target - self.decode_seconds) / self.seconds_per_token)))


def _smoothed(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - _SMOOTHING) * average + _SMOOTHING * sample


@dataclass
class PrefixJob:
    """A prefix to cache in a slot of its own (``Engine.register_prefix``); ``done`` is set once it is."""

    tokens: list[int]
    done: threading.Event = field(default_factory=threading.Event)
    slot: int = -1
    error: str | None = None


@dataclass(frozen=True)
class PrefillChunk:
    """The next ``tokens`` of one request's prompt, after the ``start`` already in its slot."""

    request: Request
    start: int
    tokens: list[int]

    @property
    def last(self) -> bool:
        """Whether this chunk ends the prompt (its logits give the first token)."""
        return self.start + len(self.tokens) == len(self.request.context)


@dataclass(frozen=True)
class PrefillBatch:
    """Prompts' pieces, all one length and after pasts of one length, in consecutive slots: one call (``Scheduler(batch_prompts=True)``).

    GroupQueryAttention runs several tokens a row in one call only when no row has a past
    (its first-prompt path), so a piece after a past shares a call only where every attention
    of the runner's graph takes such a call as the CPU products (an 8-bit cache's;
    ``Scheduler(batch_after_past=True)``);
    elsewhere only a prompt's first piece, from position 0, does, and the rest of a longer
    prompt follows at batch 1. Rows are slots ``first..first+len(chunks)-1``, in that order.
    """

    chunks: tuple[PrefillChunk, ...]

    @property
    def first(self) -> int:
        """The first row's slot."""
        return self.chunks[0].request.slot

    @property
    def start(self) -> int:
        """The tokens each row holds before its piece (one count for every row)."""
        return self.chunks[0].start

    @property
    def tokens(self) -> int:
        """The call's prompt tokens, over every row."""
        return sum(len(chunk.tokens) for chunk in self.chunks)


@dataclass
class StepPlan:
    """What one step does before its decode call."""

    admitted: list[tuple[Request, Placement]] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)  # cancelled while they waited
    cancelled: list[Request] = field(default_factory=list)  # cancelled once admitted (their slots stay held until they end)
    prefixes: list[PrefixJob] = field(default_factory=list)  # prefill whole, then pin
    prefill: list[PrefillChunk | PrefillBatch] = field(default_factory=list)  # the calls, in order
    burst: bool = False  # planned in a burst (no more streams running than prompts prefilling, batch_prompts)
    waiting: int = 0  # requests the plan left waiting (more later: some came since)


@dataclass
class DecodePlan:
    """One decode call over slots ``0..rows-1``, or over the running requests' slots (``slots``), or one speculative round (``speculative``).

    Row ``i`` feeds ``tokens[i]`` at ``positions[i]`` and attends over its first
    ``positions[i] + 1`` rows; rows not in ``requests`` (free or still prefilling) write one
    harmless row where their next real row will go. ``slots`` (the paged cache, a call of
    its own): row ``i`` is ``requests[i]`` in slot ``slots[i]``, and no other row runs.
    """

    rows: int = 0
    requests: list[Request] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    speculative: SpeculativePlan | None = None
    slots: list[int] | None = None

    @property
    def request_rows(self) -> list[int]:
        """The call's row of each of ``requests``: its place among them (``slots``), else its slot."""
        return list(range(len(self.requests))) if self.slots is not None else [r.slot for r in self.requests]


@dataclass(frozen=True)
class SpeculativePlan:
    """One speculative round for ``request`` alone: draft after ``context`` (its cached tokens and the pending one)."""

    request: Request
    context: list[int]
    room: int  # drafts that fit: tokens left to generate, rows left in the slot
    budget: DraftBudget


@dataclass(frozen=True)
class MixedCall:
    """A round's last prompt chunk and its decode call over every running row, in one call (``EngineConfig.mixed_step``)."""

    chunk: PrefillChunk
    decode: DecodePlan


Call: TypeAlias = PrefixJob | PrefillChunk | PrefillBatch | MixedCall | DecodePlan | SpeculativePlan


@dataclass
class CallPlan:
    """What one engine step runs: a round's admissions, drops and cancels (its first step), then at most one call.

    ``start``: the round's :class:`StepPlan` on its first step (the admitted requests' rows
    to copy, the requests to end as cancelled), else None. ``call``: the model call.
    """

    start: StepPlan | None = None
    call: Call | None = None

    @property
    def chunks(self) -> tuple[PrefillChunk, ...]:
        """The prompt chunks the call runs, in the order of its prompt logits."""
        call = self.call
        if isinstance(call, PrefillChunk):
            return (call,)
        if isinstance(call, PrefillBatch):
            return call.chunks
        if isinstance(call, MixedCall):
            return (call.chunk,)
        return ()

    @property
    def decode(self) -> DecodePlan | None:
        """The decode call's rows, when the call decodes (alone or beside a chunk)."""
        if isinstance(self.call, DecodePlan):
            return self.call
        if isinstance(self.call, MixedCall):
            return self.call.decode
        return None


@dataclass
class _Round:
    """A round under way: its plan, the prefixes still to cache, and where its prompt calls are."""

    plan: StepPlan
    prefixes: collections.deque[PrefixJob]
    next_call: int = 0


class Ran(Protocol):
    """What the scheduler reads of a call's run (a :class:`~kvexport.serving.runner.ModelOutput`)."""

    @property
    def seconds(self) -> float:
        """How long the call took."""

    @property
    def drafts(self) -> Sequence[int]:
        """A speculative round's drafted tokens."""

    @property
    def kept(self) -> int:
        """How many of the drafts were kept."""

    @property
    def error(self) -> str | None:
        """Why a prefix was not cached (None: it was)."""


class Outputs(Protocol):
    """What the scheduler reads of a step's outputs (an :class:`~kvexport.serving.output.OutputBatch`)."""

    @property
    def tokens(self) -> dict[str, list[int]]:
        """Per request id, the tokens it took."""

    @property
    def finished(self) -> Sequence[Ended]:
        """The requests that ended."""

    @property
    def generated(self) -> int:
        """Tokens made."""


class Ended(Protocol):
    """A request that ended, and why."""

    @property
    def request_id(self) -> str:
        """Its id."""

    @property
    def reason(self) -> str:
        """``stop``, ``length``, ``cancelled`` or ``error``."""


@dataclass
class EngineStats:
    """A snapshot of the engine's state (``/metrics`` and tests read it).

    ``prompt_tokens`` counts the prompt tokens prefilled; ``cached_tokens`` those reused
    from the prefix cache instead, over ``prefix_hits`` requests; ``pinned`` the slots
    kept for registered prefixes; ``drafted_tokens`` / ``accepted_tokens`` the speculative
    drafts proposed and kept; ``mixed_steps`` the decode steps that ran in one call with a
    prompt chunk (``EngineConfig.mixed_step``); ``batched_prompts`` the prompts whose first
    piece ran in one call with others' (``EngineConfig.batch_prompts``), ``batched_pieces``
    the later pieces (after a past) that did. Over the paged cache: ``kv_blocks`` the pool's
    blocks, ``kv_blocks_used`` those slots hold (cached prefixes too), ``preemptions`` the
    requests whose rows were given up for others' when the pool ran out (0 and 0 otherwise).
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
    mixed_steps: int = 0
    batched_prompts: int = 0
    batched_pieces: int = 0
    preemptions: int = 0
    kv_blocks: int = 0
    kv_blocks_used: int = 0
    finished: dict[str, int] = field(default_factory=dict)


_COUNTERS = (
    "steps", "prompt_tokens", "generated_tokens", "prefix_hits", "cached_tokens", "drafted_tokens", "accepted_tokens", "mixed_steps",
    "batched_prompts", "batched_pieces", "preemptions",
)


class Scheduler:
    """Who runs next and in which slot (see the module docstring).

    Args:
        table: the cache's bookkeeping.
        budget: the prompt tokens each step prefills, over all prompts, in calls of at most
            its ``chunk`` tokens (one request's piece).
        max_queue: requests that may wait beyond the free slots.
        capacity: tokens per slot.
        draft_tokens: the most drafts per speculative round.
        batch_prompts: in a burst (no more streams running than prompts prefilling), run
            fresh prompts' first pieces in consecutive slots as one call
            (:class:`PrefillBatch`, :meth:`_batches`) where the runner can.
        batch_tokens: the most prompt tokens of one shared call, over its rows (None: the
            step's budget); a larger group shares several calls. An ``--all-logits``
            graph's call returns logits for each token.
        batch_after_past: with ``batch_prompts``, later pieces share calls too: those of
            prompts in consecutive slots that hold as many tokens each (a burst's second
            pieces), where the runner can (``ModelRunner.can_batch_after_past``).
        mixed: a round's last prompt chunk runs in one call with its decode call
            (:class:`MixedCall`), where the runner has the mixed step.
        speculate: a request running alone decodes speculatively (an engine with a drafter).

    """

    def __init__(
        self,
        table: SlotTable,
        *,
        budget: PrefillBudget,
        max_queue: int,
        capacity: int,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        batch_prompts: bool = False,
        batch_tokens: int | None = None,
        batch_after_past: bool = False,
        mixed: bool = False,
        speculate: bool = False,
    ) -> None:
        self.table = table
        self.mixed = mixed
        self.speculate = speculate
        self.batch_prompts = batch_prompts
        self.batch_after_past = batch_after_past
        self.batch_tokens = batch_tokens
        self.budget = budget
        self.max_queue = max_queue
        self.capacity = capacity
        self.draft_tokens = draft_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: dict[int, Request] = {}  # slot -> request (prefilling or running)
        self.prefix_jobs: collections.deque[PrefixJob] = collections.deque()
        self.requests: dict[str, Request] = {}  # id -> every request not finished yet
        self._round: _Round | None = None  # the round whose calls next_call hands out
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._finished: collections.Counter[str] = collections.Counter()

    @property
    def idle(self) -> bool:
        """Nothing to do."""
        return not self.waiting and not self.active and not self.prefix_jobs

    @property
    def at_rest(self) -> bool:
        """No round under way, no request admitted and no prefix to cache: the next round may start a burst."""
        return self._round is None and not self.active and not self.prefix_jobs

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self.waiting)

    @property
    def request_slots(self) -> int:
        """The slots requests may take: all but those kept for registered prefixes."""
        return len(self.table) - self.table.pinned

    def stats(self) -> EngineStats:
        """What the scheduler holds and has counted so far."""
        in_use, prefilling, waiting = self.counts()
        blocks = self.table.blocks
        return EngineStats(
            kv_blocks=blocks.blocks - 1 if blocks is not None else 0,
            kv_blocks_used=blocks.used if blocks is not None else 0,
            slots=len(self.table),
            slots_in_use=in_use,
            running=in_use - prefilling,
            waiting=waiting,
            prefilling=prefilling,
            pinned=self.table.pinned,
            finished=dict(self._finished),
            **self._counters,
        )

    def forget(self) -> None:
        """Drop the counts, the cached rows and the measured costs (after the engine's warm-up)."""
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._finished.clear()
        self.table.forget()
        self.budget.forget()

    def add(self, request: Request) -> None:
        """Queue a request; :class:`EngineFull` when ``max_queue`` already wait beyond the free slots."""
        self.add_all([request])

    def add_all(self, requests: Sequence[Request], *, bounded: bool = True) -> None:
        """Queue all of ``requests`` or none (:class:`EngineFull`); ``bounded`` False: past ``max_queue`` too (the warm-up)."""
        free = len(self.table) - len(self.active) - self.table.pinned
        for queued in range(len(requests)):
            if bounded and len(self.waiting) + queued >= self.max_queue + max(0, free):
                raise EngineFull(f"{len(self.waiting) + queued} requests are waiting for a slot; retry shortly")
        self.waiting.extend(requests)
        self.requests.update((request.id, request) for request in requests)

    def check_fits(self, requests: int) -> None:
        """Refuse ``requests`` sent together that could never all be queued (a 503 would never clear)."""
        slots = len(self.table) - self.table.pinned
        if requests > self.max_queue + slots:
            raise ParameterError(
                f"n {requests}: one request asks for {requests} sequences, more than this server queues at once "
                f"({self.max_queue} waiting + {slots} slots); send fewer prompts or a smaller n",
                parameter="n",
            )

    def add_prefix(self, job: PrefixJob) -> None:
        """Queue a prefix to cache in a slot of its own; refused when all but one slot would hold prefixes."""
        if self.table.pinned + len(self.prefix_jobs) >= len(self.table) - 1:
            raise KvexportError(f"all but one of the {len(self.table)} slots hold registered prefixes; unregister one first")
        self.prefix_jobs.append(job)

    def prefix_cached(self, job: PrefixJob) -> None:
        """``job``'s prefix ran: its pinned slot holds it."""
        self.table.wrote(job.slot, 0, job.tokens)

    def prefix_failed(self, job: PrefixJob) -> None:
        """``job``'s prefix was not cached: its slot is free again, its rows invalid."""
        self.table.unpin_slot(job.slot)
        self.table.release(job.slot, valid=False)

    def unpin(self, tokens: Sequence[int]) -> bool:
        """Free the slot kept for the prefix ``tokens``; False if none is."""
        return self.table.unpin(tokens)

    def __iter__(self) -> Iterator[Request]:
        """Every request not finished: waiting, prefilling or running."""
        return iter(list(self.requests.values()))

    def counts(self) -> tuple[int, int, int]:
        """Requests holding a slot, prefilling and waiting."""
        prefilling = sum(r.status is Status.PREFILLING for r in self.active.values())
        return len(self.active), prefilling, len(self.waiting)

    def schedule(self) -> StepPlan:
        """Admit what fits, pin waiting prefixes, and choose this step's prompt chunks."""
        plan = StepPlan(dropped=[r for r in self.waiting if r.cancelled], cancelled=self.take_cancelled())
        for request in plan.dropped:  # a caller that left while it waited
            self.waiting.remove(request)
        blocks = self.table.blocks
        if blocks is not None:
            self._make_room(blocks)
        free = self.table.free(self.active)
        while self.prefix_jobs and free:
            if blocks is not None and not self.table.reclaim(self.active, blocks.needed_to_admit(len(self.prefix_jobs[0].tokens))):
                break  # it waits for blocks
            job = self.prefix_jobs.popleft()
            job.slot = self.table.pin_slot(free)
            free.remove(job.slot)
            if blocks is not None:
                blocks.assign(job.slot, 0, len(job.tokens))
            plan.prefixes.append(job)
        held: list[Request] = []
        while self.waiting and free:
            request = self.waiting.popleft()
            if self._waits_for_rows(request):
                held.append(request)  # a sibling of n > 1: its prompt is prefilled once, by the first
                continue
            if blocks is not None and not self.table.reclaim(self.active, blocks.needed_to_admit(len(request.context) + 1)):
                self.waiting.appendleft(request)  # first come, first served: the rest wait behind it for blocks
                break
            rows = max(self.active, default=-1) + 1
            placement = self.table.place(request.context, free, rows, reuse=not request.wants_whole_prompt)
            free.remove(placement.slot)
            request.slot, request.status = placement.slot, Status.PREFILLING
            request.prefilled = request.length = request.cached_tokens = placement.reused
            self.active[placement.slot] = request
            plan.admitted.append((request, placement))
            if placement.reused:
                self._counters["prefix_hits"] += 1
                self._counters["cached_tokens"] += placement.reused
        self.waiting.extendleft(reversed(held))
        prefilling = sorted((r for r in self.active.values() if r.status is Status.PREFILLING), key=lambda r: r.submitted)
        running = len(self.active) - len(prefilling)
        budget = self.budget.tokens(running=running, prefilling=len(prefilling))
        starts = {request.id: request.prefilled for request in prefilling}
        # only in a burst: while more streams run, the small budget goes to the oldest prompt first
        bursting = plan.burst = self.batch_prompts and running <= len(prefilling)
        while bursting:  # rounds of shared calls: a round's rows then hold as many tokens, and their next pieces may share too
            batches = self._batches(prefilling, starts, budget)
            for batch in batches:
                plan.prefill.append(batch)
                budget -= batch.tokens
                starts.update((chunk.request.id, chunk.start + len(chunk.tokens)) for chunk in batch.chunks)
            bursting = bool(batches) and self.batch_after_past
        for request in prefilling:
            start = starts[request.id]
            while budget and start < len(request.context):  # pieces of at most chunk tokens, in order
                piece = request.context[start : start + min(budget, self.budget.chunk)]
                plan.prefill.append(PrefillChunk(request, start, piece))
                start += len(piece)
                budget -= len(piece)
        plan.waiting = len(self.waiting)
        return plan

    def _make_room(self, blocks: BlockManager) -> None:
        """Paged: back each running request's next positions with blocks, oldest first; preempt the newest while the pool is short.

        A running request writes one position a decode call (a lone one with speculative
        decoding: up to its drafts more). Where the free blocks and those that free slots cache
        do not cover that, the request admitted last gives its blocks up (:meth:`preempt`),
        as vLLM's scheduler does, and is recomputed when blocks are free again.
        """
        running = sorted((r for r in self.active.values() if r.status is Status.RUNNING), key=lambda r: r.submitted)
        ahead = 1 + (self.draft_tokens if self.speculate and len(self.active) == 1 else 0)
        for request in running:
            end = min(request.length + ahead, self.capacity)
            while request.status is Status.RUNNING and not self.table.reclaim(self.active, blocks.needed(request.slot, end)):
                self.preempt(max(self.active.values(), key=lambda r: r.submitted))
            if request.status is Status.RUNNING:
                blocks.grow(request.slot, end)

    def preempt(self, request: Request) -> None:
        """Give up ``request``'s slot and rows; it waits first in line, to prefill its prompt and the tokens it generated again.

        Its pending token (the last it generated) is fed by its next decode call as before, so
        it goes on with the tokens it would have had; nothing it streamed is sent again.
        """
        del self.active[request.slot]
        self.table.release(request.slot, valid=False)
        request.status, request.slot = Status.WAITING, -1
        request.prefilled = request.length = request.cached_tokens = 0
        request.resume = [*request.prompt, *request.output[:-1]] if request.output else None
        self.waiting.appendleft(request)
        self._counters["preemptions"] += 1

    def next_call(self) -> CallPlan | None:
        """The next step's plan: a new round's start (:meth:`schedule`) with its first call, or the round's next call.

        A round hands out its prefixes, then its prompt calls in order, then its decode call
        (:meth:`decode_plan`), planned once the calls before it have run and their outputs
        are in (:meth:`update_from_output`). On the way it skips a chunk whose request was
        cancelled (it ends next round), ends a round planned in a burst early, between two
        calls, when requests came with slots free for them (:meth:`_arrived`), and runs the
        round's last chunk in one call with its decode call (:class:`MixedCall`) when
        ``mixed``. A round whose start ends requests (cancelled) runs no call on that step,
        so that they have ended before its calls are planned. None: the round under way
        ended with no call (nothing runs); the next call starts a new one.
        """
        start = None
        if self._round is None:
            start = self.schedule()
            self._round = _Round(start, collections.deque(start.prefixes))
            if start.dropped or start.cancelled:
                return CallPlan(start)
        call = self._round_call(self._round)
        if call is None or isinstance(call, (DecodePlan, MixedCall, SpeculativePlan)):
            self._round = None  # the decode call ends the round
        if start is None and call is None:
            return None
        return CallPlan(start, call)

    def _round_call(self, current: _Round) -> Call | None:
        """The round's next call (see :meth:`next_call`); None once it has none left."""
        if current.prefixes:
            return current.prefixes.popleft()
        plan = current.plan
        while current.next_call < len(plan.prefill):
            index = current.next_call
            current.next_call += 1
            call = plan.prefill[index]
            if plan.burst and index and self._arrived(plan):  # the rest of the plan is planned again, with them
                break
            if isinstance(call, PrefillBatch):
                return call
            if call.request.status is not Status.PREFILLING or call.request.cancelled:  # a cancel ends it next round
                continue
            if call.start != call.request.prefilled:  # an earlier piece did not run: this one would leave a gap
                continue
            if self.mixed and index == len(plan.prefill) - 1:  # the round's last chunk and its decode call, in one call
                decode = self.decode_plan(beside=call)
                if decode is not None:
                    return MixedCall(call, decode)
            return call
        current.next_call = len(plan.prefill)
        decode = self.decode_plan(speculate=self.speculate)
        if decode is not None and decode.speculative is not None:
            return decode.speculative
        return decode

    def _arrived(self, plan: StepPlan) -> bool:
        """Whether requests came since ``plan`` was made, with slots free for them.

        A burst over HTTP reaches the engine over tens of ms, and a round that prefills a
        burst runs for a second or more (up to ``BURST_TOKENS`` tokens): requests that miss
        its plan would wait for all of it, then share smaller calls. So a round planned in a
        burst ends early, between two calls, when more come: the next plan admits them, and
        their first pieces share calls with the prompts not yet begun. Sixteen 512-token
        requests sent at once by ``benchmarks/serve_load.py`` reached the engine as 7 then 9,
        or as 1 then 15 (the first one's two pieces, 265 ms, ran before the rest were admitted).
        """
        return len(self.waiting) > plan.waiting and bool(self.table.free(self.active))

    def end_round(self) -> list[PrefixJob]:
        """A call failed: the round under way ends; its prefixes not yet cached are given up (their slots free again), and returned."""
        left = list(self._round.prefixes) if self._round is not None else []
        self._round = None
        for job in left:
            self.prefix_failed(job)
        return left

    def _batches(self, prefilling: Sequence[Request], starts: dict[str, int], budget: int) -> list[PrefillBatch]:
        """The prompts' next pieces that share calls, within ``budget`` tokens, each prompt's after its ``starts`` tokens.

        A fresh prompt (nothing of it in its slot yet) offers a first piece of at most
        ``chunk`` tokens; with ``batch_after_past``, a prompt partly in its slot offers its
        next piece too. Runs of consecutive slots whose prompts hold as many tokens are cut
        into groups, each a call of its rows' pieces cut to the group's shortest: the cut
        that batches the most tokens (:func:`_grouped`), where each call, and each piece cut
        short (its rest is one more call), costs :data:`CALL_COST` tokens. A group is
        trimmed to the rows the budget holds; the rest of a prompt longer than its group's
        pieces goes on in later calls. A group over ``batch_tokens`` is split into that many
        calls more, of as even a number of rows as divide it; a call left with one row is
        left out (it runs at batch 1).
        """
        offered = (
            r for r in prefilling if not r.cancelled and starts[r.id] < len(r.context) and (starts[r.id] == 0 or self.batch_after_past)
        )
        runs: list[list[Request]] = []
        for request in sorted(offered, key=lambda r: r.slot):
            if runs and request.slot == runs[-1][-1].slot + 1 and starts[request.id] == starts[runs[-1][-1].id]:
                runs[-1].append(request)
            else:
                runs.append([request])
        batches = []
        for run in runs:
            start = starts[run[0].id]
            pieces = [min(len(r.context) - start, self.budget.chunk) for r in run]
            for first, end in _grouped(pieces):
                width = min(pieces[first:end])
                rows = run[first:end][: budget // width]
                if not rows:
                    continue
                per_call = len(rows) if self.batch_tokens is None else max(1, self.batch_tokens // width)
                for part in _even_parts(rows, -(-len(rows) // per_call)):
                    if len(part) >= 2:
                        batches.append(PrefillBatch(tuple(PrefillChunk(r, start, r.context[start : start + width]) for r in part)))
                        budget -= width * len(part)
        return batches

    def _waits_for_rows(self, request: Request) -> bool:
        """Whether a sibling of n > 1 waits for the first's prompt: only where its rows can then be copied."""
        first = request.after
        if first is None or first.status not in (Status.WAITING, Status.PREFILLING):
            return False
        return self.table.prefix_cache and self.table.can_copy_rows and len(request.prompt) - 1 >= MIN_COPIED_PREFIX

    def prefilled(self, chunk: PrefillChunk) -> None:
        """``chunk`` ran: its rows are in the slot."""
        request = chunk.request
        request.prefilled = request.length = chunk.start + len(chunk.tokens)
        self.table.wrote(request.slot, chunk.start, chunk.tokens)
        if chunk.last:
            request.status = Status.RUNNING

    def decode_plan(self, *, speculate: bool = False, beside: PrefillChunk | None = None) -> DecodePlan | None:
        """The decode call for every running row (None: none runs); the rows it writes are recorded.

        A speculative round instead when ``speculate`` and one plain request runs alone with
        nothing waiting. ``beside``: the prompt chunk that runs in the same call (the mixed
        step); its slot's decode row writes just past the chunk's rows, not among them.
        """
        running = [r for r in self.active.values() if r.status is Status.RUNNING]
        if not running:
            return None
        alone = running[0]
        if speculate and len(self.active) == 1 and not self.waiting and _plain(alone):
            return DecodePlan(speculative=self._speculative_plan(alone))
        if self.table.blocks is not None and beside is None:  # paged: each row reads its slot's table, so only the running run
            plan = DecodePlan(rows=len(running), requests=running, slots=[r.slot for r in running])
            for each in running:
                plan.tokens.append(each.next_token)
                plan.positions.append(each.length)
                self.table.wrote(each.slot, each.length, [each.next_token])
                each.length += 1
            return plan
        plan = DecodePlan(rows=max(r.slot for r in running) + 1, requests=running)
        for slot in range(plan.rows):
            request = self.active.get(slot)
            if request is not None and request.status is Status.RUNNING:
                plan.tokens.append(request.next_token)
                plan.positions.append(request.length)
                self.table.wrote(slot, request.length, [request.next_token])
                request.length += 1
            else:  # a free or prefilling slot writes one row just past the rows it keeps
                self.table.keep(slot, self.capacity - 1)
                plan.tokens.append(0)
                if beside is not None and beside.request.slot == slot:
                    plan.positions.append(min(beside.start + len(beside.tokens), self.capacity - 1))
                else:
                    plan.positions.append(self.table.length(slot))
        return plan

    def _speculative_plan(self, request: Request) -> SpeculativePlan:
        if request.draft_budget is None:
            request.draft_budget = DraftBudget(self.draft_tokens)
        room = min(request.params.max_tokens - len(request.output) - 1, self.capacity - request.length - 1)
        if self.table.blocks is not None:  # paged: within the blocks it holds
            room = max(0, min(room, self.table.blocks.positions(request.slot) - request.length - 1))
        context = [*self.table.residents[request.slot].tokens, request.next_token]
        return SpeculativePlan(request, context, room, request.draft_budget)

    def speculated(self, plan: SpeculativePlan, drafts: Sequence[int], kept: int) -> None:
        """A speculative round ran: the pending token and the ``kept`` drafts are in the slot; the rejected drafts' rows are free again."""
        request = plan.request
        self.table.wrote(request.slot, request.length, [request.next_token, *drafts[:kept]])
        request.length = self.table.length(request.slot)

    def update_from_output(self, plan: CallPlan, ran: Ran | None, outputs: Outputs) -> None:
        """Take a step's outputs: what its call wrote and cost, each request's new tokens (the last is fed next), the requests that ended.

        ``ran``: what the runner reported of ``plan``'s call (None: no call ran, as when a
        failed step's requests end).
        """
        if ran is not None:
            self._ran(plan.call, ran)
        self._counters["generated_tokens"] += outputs.generated
        for ended in outputs.finished:
            self._finished[ended.reason] += 1
        for request_id, tokens in outputs.tokens.items():
            request = self.requests.get(request_id)
            if request is not None and tokens:
                request.output += tokens
                request.next_token = tokens[-1]
        for ended in outputs.finished:
            request = self.requests.get(ended.request_id)
            if request is not None:
                self.finish(request, valid=ended.reason != "error")  # a failed run may have left rows half written

    def _ran(self, call: Call | None, ran: Ran) -> None:
        """``call`` ran: its rows are recorded, its time measured into the budget, its counts kept."""
        counters = self._counters
        if isinstance(call, PrefixJob):
            if ran.error is None:
                self.prefix_cached(call)
                counters["prompt_tokens"] += len(call.tokens)
            else:
                self.prefix_failed(call)
        elif isinstance(call, PrefillChunk):
            self.budget.prefilled(len(call.tokens), ran.seconds)
            self._prefilled_counted(call)
        elif isinstance(call, PrefillBatch):  # the call's time is not the budget's measure of a prompt token (one row's)
            counters["batched_pieces" if call.start else "batched_prompts"] += len(call.chunks)
            for chunk in call.chunks:  # every row, a request cancelled since the plan too: the call wrote its rows
                self._prefilled_counted(chunk)
        elif isinstance(call, MixedCall):
            self.budget.mixed(len(call.chunk.tokens), ran.seconds)
            counters["steps"] += 1
            counters["mixed_steps"] += 1
            self._prefilled_counted(call.chunk)
        elif isinstance(call, DecodePlan):
            self.budget.decoded(ran.seconds)
            counters["steps"] += 1
        elif isinstance(call, SpeculativePlan):
            self.speculated(call, ran.drafts, ran.kept)
            counters["steps"] += 1
            counters["drafted_tokens"] += len(ran.drafts)
            counters["accepted_tokens"] += ran.kept

    def _prefilled_counted(self, chunk: PrefillChunk) -> None:
        self.prefilled(chunk)
        self._counters["prompt_tokens"] += len(chunk.tokens)

    def finish(self, request: Request, *, valid: bool = True) -> None:
        """``request`` ended: it leaves the queue, or its slot is free again (its rows stay cached when ``valid``)."""
        if self.active.get(request.slot) is request:
            del self.active[request.slot]
            self.table.release(request.slot, valid=valid)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.requests.pop(request.id, None)
        request.status = Status.FINISHED

    def unfinished(self, *, waiting: bool = False) -> list[Request]:
        """The admitted requests, and the waiting ones too when ``waiting`` (what a failed step ends)."""
        return [*self.active.values(), *(self.waiting if waiting else ())]

    def take_cancelled(self) -> list[Request]:
        """The admitted requests whose callers cancelled them."""
        return [r for r in self.active.values() if r.cancelled]


def _grouped(pieces: Sequence[int]) -> list[tuple[int, int]]:
    """The groups ``[first, end)`` of consecutive ``pieces`` that batch the most tokens, two rows or more each.

    A group's call runs every row's piece cut to the shortest (``width``): it is worth
    ``width`` tokens a row, less :data:`CALL_COST` for the call and for each row cut short
    (its rest is one more call), so fewer, larger calls win a tie. Exact over every
    cut (dynamic programming, quadratic in the rows: the slots are few); single rows and
    groups worth nothing are left out (they run as before, a call each).
    """
    count = len(pieces)
    best = [0] * (count + 1)  # best[i]: the most the first i pieces are worth
    choice: list[int | None] = [None] * (count + 1)  # best[i]'s last group starts here (None: row i-1 alone)
    for end in range(1, count + 1):
        best[end] = best[end - 1]
        width, narrowest = pieces[end - 1], 1  # the group's width, and how many of its pieces are that wide
        for first in range(end - 2, -1, -1):
            if pieces[first] < width:
                width, narrowest = pieces[first], 1
            elif pieces[first] == width:
                narrowest += 1
            if width < 2:  # one token a row is a decode call's shape
                break
            size = end - first
            worth = best[first] + size * width - (size - narrowest) * CALL_COST - CALL_COST
            if worth > best[end]:
                best[end], choice[end] = worth, first
    groups = []
    end = count
    while end > 0:
        start = choice[end]
        if start is None:
            end -= 1
        else:
            groups.append((start, end))
            end = start
    return groups[::-1]


def _even_parts(rows: Sequence[Request], parts: int) -> list[Sequence[Request]]:
    """``rows`` in order, cut into ``parts`` runs whose lengths differ by at most one (none: no rows)."""
    if not rows:
        return []
    size, extra = divmod(len(rows), parts)
    cuts = [index * size + min(index, extra) for index in range(parts + 1)]
    return [rows[start:end] for start, end in itertools.pairwise(cuts)]


def _plain(request: Request) -> bool:
    """Whether speculative decoding gives this request what it would get batched: greedy, no controls, no logprobs.

    A sampled request's draws would follow another order of its random stream alone than
    batched, so its tokens would depend on the load.
    """
    params = request.params
    return request.greedy and not params.controls_logits and params.logprobs is None
