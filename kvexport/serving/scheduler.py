"""The scheduler: the queue, admission, slot placement and the prefill token budget.

Plain Python (no ONNX Runtime): each engine step asks it for a :class:`StepPlan` (which
requests enter which slots, which prefixes to pin, which prompt chunks to prefill), and,
once those have run, for a :class:`DecodePlan` (one batched call over every running row,
or a speculative round for a request running alone). It keeps the cache's bookkeeping in
step through its :class:`~kvexport.serving.slots.SlotTable`.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from kvexport.errors import KvexportError
from kvexport.serving.request import Request, Status
from kvexport.serving.slots import MIN_COPIED_PREFIX, Placement, SlotTable


class EngineFull(KvexportError):
    """The engine's queue of waiting requests is full; try again later."""


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
        return self.start + len(self.tokens) == len(self.request.prompt)


@dataclass
class StepPlan:
    """What one step does before its decode call."""

    admitted: list[tuple[Request, Placement]] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)  # cancelled while they waited
    prefixes: list[PrefixJob] = field(default_factory=list)  # prefill whole, then pin
    prefill: list[PrefillChunk] = field(default_factory=list)


@dataclass
class DecodePlan:
    """One decode call over slots ``0..rows-1``, or one speculative round (``speculative``).

    Row ``i`` feeds ``tokens[i]`` at ``positions[i]`` and attends over its first
    ``positions[i] + 1`` rows; rows not in ``requests`` (free or still prefilling) write one
    harmless row where their next real row will go.
    """

    rows: int = 0
    requests: list[Request] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    speculative: Request | None = None


class Scheduler:
    """Who runs next and in which slot (see the module docstring).

    Args:
        table: the cache's bookkeeping.
        chunk: prompt tokens prefilled per step, over all prompts.
        max_queue: requests that may wait beyond the free slots.
        capacity: tokens per slot.

    """

    def __init__(self, table: SlotTable, *, chunk: int, max_queue: int, capacity: int) -> None:
        self.table = table
        self.chunk = chunk
        self.max_queue = max_queue
        self.capacity = capacity
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: dict[int, Request] = {}  # slot -> request (prefilling or running)
        self.prefix_jobs: collections.deque[PrefixJob] = collections.deque()

    @property
    def idle(self) -> bool:
        """Nothing to do."""
        return not self.waiting and not self.active and not self.prefix_jobs

    def add(self, request: Request) -> None:
        """Queue a request; :class:`EngineFull` when ``max_queue`` already wait beyond the free slots."""
        free = len(self.table) - len(self.active) - self.table.pinned
        if len(self.waiting) >= self.max_queue + max(0, free):
            raise EngineFull(f"{len(self.waiting)} requests are waiting for a slot; retry shortly")
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        """Admit what fits, pin waiting prefixes, and choose this step's prompt chunks."""
        plan = StepPlan(dropped=[r for r in self.waiting if r.cancelled])
        for request in plan.dropped:  # a caller that left while it waited
            self.waiting.remove(request)
        free = self.table.free(self.active)
        while self.prefix_jobs and free:
            job = self.prefix_jobs.popleft()
            job.slot = self.table.pin_slot(free)
            self.table.residents[job.slot].pinned = True
            free.remove(job.slot)
            plan.prefixes.append(job)
        held: list[Request] = []
        while self.waiting and free:
            request = self.waiting.popleft()
            if self._waits_for_rows(request):
                held.append(request)  # a sibling of n > 1: its prompt is prefilled once, by the first
                continue
            rows = max(self.active, default=-1) + 1
            placement = self.table.place(request.prompt, free, rows, reuse=not request.wants_whole_prompt)
            free.remove(placement.slot)
            request.slot, request.status = placement.slot, Status.PREFILLING
            request.prefilled = request.length = request.cached_tokens = placement.reused
            self.active[placement.slot] = request
            plan.admitted.append((request, placement))
        self.waiting.extendleft(reversed(held))
        budget = self.chunk
        prefilling = sorted((r for r in self.active.values() if r.status is Status.PREFILLING), key=lambda r: r.submitted)
        for request in prefilling:
            if budget == 0:
                break
            piece = request.prompt[request.prefilled : request.prefilled + budget]
            plan.prefill.append(PrefillChunk(request, request.prefilled, piece))
            budget -= len(piece)
        return plan

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

    def decode_plan(self, *, speculate: bool = False) -> DecodePlan | None:
        """The decode call for every running row (None: none runs).

        A speculative round instead when ``speculate`` and one plain request runs alone with
        nothing waiting.
        """
        running = [r for r in self.active.values() if r.status is Status.RUNNING]
        if not running:
            return None
        alone = running[0]
        if speculate and len(self.active) == 1 and not self.waiting and _plain(alone):
            return DecodePlan(speculative=alone)
        plan = DecodePlan(rows=max(r.slot for r in running) + 1, requests=running)
        for slot in range(plan.rows):
            request = self.active.get(slot)
            tokens = self.table.residents[slot].tokens
            if request is not None and request.status is Status.RUNNING:
                plan.tokens.append(request.next_token)
                plan.positions.append(request.length)
                tokens.append(request.next_token)
            else:  # a free or prefilling slot writes one row just past the rows it keeps
                self.table.keep(slot, self.capacity - 1)
                plan.tokens.append(0)
                plan.positions.append(len(tokens))
        return plan

    def finish(self, request: Request, *, valid: bool = True) -> None:
        """``request`` ended: its slot is free again (its rows stay cached when ``valid``)."""
        if self.active.get(request.slot) is request:
            del self.active[request.slot]
            self.table.release(request.slot, valid=valid)
        request.status = Status.FINISHED

    def take_cancelled(self) -> list[Request]:
        """The admitted requests whose callers cancelled them."""
        return [r for r in self.active.values() if r.cancelled]


def _plain(request: Request) -> bool:
    """Whether speculative decoding gives this request what it would get batched: greedy, no controls, no logprobs.

    A sampled request's draws would follow another order of its random stream alone than
    batched, so its tokens would depend on the load.
    """
    params = request.params
    return not request.sampling.do_sample and not params.controls_logits and params.logprobs is None
