"""The scheduler and the cache's bookkeeping, in plain Python: no ONNX Runtime, no model."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from kvexport.serving.config import EngineConfig
from kvexport.serving.request import Request, SamplingParams, Status
from kvexport.serving.scheduler import (
    CALL_COST,
    DecodePlan,
    EngineFull,
    PrefillBatch,
    PrefillBudget,
    PrefillChunk,
    PrefixJob,
    Scheduler,
    _grouped,
)
from kvexport.serving.slots import MIN_COPIED_PREFIX, SlotTable

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def _scheduler(
    slots: int = 4, chunk: int = 8, max_queue: int = 4, can_copy: bool = True, budget: PrefillBudget | None = None
) -> Scheduler:
    """A scheduler whose steps prefill ``chunk`` tokens (unless ``budget`` says otherwise)."""
    ticks = itertools.count()
    table = SlotTable(slots, can_copy_rows=can_copy, clock=lambda: float(next(ticks)))
    budget = budget or PrefillBudget(chunk, burst=chunk)
    return Scheduler(table, budget=budget, max_queue=max_queue, capacity=64)


def _run_prefill(scheduler: Scheduler) -> None:
    """Plan steps and mark their chunks done until no request is prefilling."""
    while any(r.status is Status.PREFILLING for r in scheduler.active.values()) or scheduler.waiting:
        plan = scheduler.schedule()
        for chunk in plan.prefill:
            scheduler.prefilled(chunk)
        if not plan.prefill and not plan.admitted:
            return


def test_admission_fills_free_slots_lowest_first_and_the_prefill_budget_spans_prompts() -> None:
    scheduler = _scheduler(slots=2, chunk=8)
    requests = [Request(f"r{i}", list(range(1, 6 + i)), GREEDY) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    plan = scheduler.schedule()
    assert [(r.id, p.slot, p.reused) for r, p in plan.admitted] == [("r0", 0, 0), ("r1", 1, 0)]
    # the oldest prompt first: r0's 5 tokens, then 3 of r1's 6
    assert [(c.request.id, c.start, len(c.tokens), c.last) for c in plan.prefill] == [("r0", 0, 5, True), ("r1", 0, 3, False)]
    for chunk in plan.prefill:
        scheduler.prefilled(chunk)
    assert requests[0].status is Status.RUNNING and requests[1].status is Status.PREFILLING
    assert list(scheduler.waiting) == [requests[2]]  # no slot for it yet
    second = scheduler.schedule()
    assert [(c.request.id, c.start, len(c.tokens)) for c in second.prefill] == [("r1", 3, 3)]


def test_the_decode_plan_feeds_running_rows_and_gives_idle_rows_a_harmless_position() -> None:
    scheduler = _scheduler(slots=3, chunk=64)
    a, b = Request("a", [5, 6, 7], GREEDY), Request("b", [8, 9], GREEDY)
    scheduler.add(a)
    scheduler.add(b)
    _run_prefill(scheduler)
    a.next_token, b.next_token = 11, 12
    scheduler.finish(a)  # slot 0 is free again, its rows stay cached
    plan = scheduler.decode_plan()
    assert plan is not None and plan.rows == 2 and plan.requests == [b]
    assert plan.tokens == [0, 12] and plan.positions == [3, 2]  # slot 0 writes just past what it keeps
    assert scheduler.table.residents[1].tokens == [8, 9, 12]


def test_a_cached_prefix_is_reused_in_place_or_copied_and_at_least_one_token_is_left() -> None:
    scheduler = _scheduler(slots=3, chunk=64)
    shared = list(range(100, 100 + MIN_COPIED_PREFIX + 4))
    first = Request("first", [*shared, 1], GREEDY)
    scheduler.add(first)
    _run_prefill(scheduler)
    scheduler.finish(first)
    same = Request("same", list(first.prompt), GREEDY)
    scheduler.add(same)
    plan = scheduler.schedule()
    (_, placement), = plan.admitted
    assert (placement.slot, placement.reused, placement.copy_from) == (0, len(first.prompt) - 1, None)  # in place
    assert plan.prefill[0].tokens == [1]  # the last token still runs: its logits give the first token
    busy = Request("busy", [*shared, 2], GREEDY)  # slot 0 is taken now: the rows are copied
    scheduler.add(busy)
    (_, copied), = scheduler.schedule().admitted
    assert (copied.slot, copied.reused, copied.copy_from) == (1, len(shared), 0)
    assert scheduler.table.residents[1].tokens == shared


def test_without_row_copies_or_with_prompt_logprobs_nothing_is_copied() -> None:
    scheduler = _scheduler(slots=3, can_copy=False)
    shared = list(range(200, 200 + MIN_COPIED_PREFIX + 4))
    first = Request("first", [*shared, 1], GREEDY)
    scheduler.add(first)
    _run_prefill(scheduler)
    other = Request("other", [*shared, 2], GREEDY)
    scheduler.add(other)
    (_, placement), = scheduler.schedule().admitted
    assert placement.copy_from is None and placement.reused == 0
    scheduler.finish(first)
    whole = Request("whole", [*shared, 1], SamplingParams(max_tokens=1, prompt_logprobs=0))
    scheduler.add(whole)
    (_, placement), = scheduler.schedule().admitted
    assert placement.reused == 0  # every prompt position must run


def test_siblings_of_n_wait_for_the_first_prompt_then_reuse_its_rows() -> None:
    scheduler = _scheduler(slots=3, chunk=8)
    prompt = list(range(300, 300 + MIN_COPIED_PREFIX + 8))
    first = Request("first", prompt, GREEDY)
    sibling = Request("sibling", prompt, GREEDY, after=first)
    late = Request("late", [1, 2], GREEDY)
    for request in (first, sibling, late):
        scheduler.add(request)
    plan = scheduler.schedule()
    assert [r.id for r, _ in plan.admitted] == ["first", "late"]  # the sibling is held, a later request is not
    assert list(scheduler.waiting) == [sibling]
    _run_prefill(scheduler)
    assert first.status is Status.RUNNING and sibling.status is Status.RUNNING
    assert sibling.cached_tokens == len(prompt) - 1 and sibling.slot == 2


def test_cancelled_requests_leave_the_queue_and_a_full_queue_refuses() -> None:
    scheduler = _scheduler(slots=1, max_queue=1)
    running, waiting = Request("running", [1], GREEDY), Request("waiting", [2], GREEDY)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()  # one slot, one place in the queue: both taken
    with pytest.raises(EngineFull, match="^1 requests are waiting for a slot; retry shortly$"):
        scheduler.add(Request("refused", [4], GREEDY))
    waiting.cancel()
    plan = scheduler.schedule()
    assert plan.dropped == [waiting] and not scheduler.waiting
    scheduler.add(Request("queued", [3], GREEDY))  # its place is free again
    running.cancel()
    assert scheduler.take_cancelled() == [running]


def test_a_prefix_job_takes_the_highest_free_slot_and_pins_it() -> None:
    scheduler = _scheduler(slots=3)
    job = PrefixJob([7, 8, 9])
    scheduler.prefix_jobs.append(job)
    plan = scheduler.schedule()
    assert plan.prefixes == [job] and job.slot == 2 and scheduler.table.pinned == 1
    assert scheduler.table.free(scheduler.active) == [0, 1]
    scheduler.table.wrote(2, 0, job.tokens)
    assert scheduler.table.unpin([7, 8, 9]) and not scheduler.table.unpin([7, 8, 9])


def test_engine_config_parses_every_field_from_strings() -> None:
    config = EngineConfig.from_strings(
        {"slots": "4", "max_context": "none", "prefix_cache": "false", "draft": "/x", "spinning": "0", "warm_up": "0"}
    )
    assert (config.slots, config.max_context, config.prefix_cache, config.draft, config.spinning) == (4, None, False, "/x", False)
    sized = EngineConfig.from_strings({"kv_memory": "1.5GiB"})
    assert sized.kv_memory == 3 * 2**29 and EngineConfig.from_strings({"kv_memory": "2000"}).kv_memory == 2000
    with pytest.raises(Exception, match="^'lots': not a size; write bytes, or a number with B, KB, MB, GB, KiB, MiB or GiB$"):
        EngineConfig.from_strings({"kv_memory": "lots"})
    with pytest.raises(Exception, match="unknown engine setting 'slot'; the settings are slots, max_context"):
        EngineConfig.from_strings({"slot": "4"})
    with pytest.raises(Exception, match="^prefix_cache=maybe: expected true or false$"):
        EngineConfig.from_strings({"prefix_cache": "maybe"})
    with pytest.raises(Exception, match="^slots 0: must be at least 1$"):
        EngineConfig(slots=0)


def test_a_burst_prefills_every_waiting_prompt_in_one_step_in_pieces_of_at_most_chunk() -> None:
    scheduler = _scheduler(slots=3, chunk=8, budget=PrefillBudget(8))  # the default burst
    requests = [Request(f"r{i}", list(range(1, 21)), GREEDY) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    plan = scheduler.schedule()
    pieces = [(c.request.id, c.start, len(c.tokens), c.last) for c in plan.prefill]
    assert pieces == [(f"r{i}", start, size, start + size == 20) for i in range(3) for start, size in ((0, 8), (8, 8), (16, 4))]


def test_while_more_streams_run_than_prompts_wait_a_step_stays_within_twice_a_full_decode_step() -> None:
    budget = PrefillBudget(256)
    assert budget.tokens(running=9, prefilling=1) == 256  # nothing measured yet: a whole chunk
    budget.prefilled(32, 0.032)  # 1 ms a prompt token
    budget.decoded(0.040)  # a full batch's decode step
    assert budget.tokens(running=9, prefilling=1) == 40 and budget.tokens(running=3, prefilling=3) == 4096  # 80 ms a step, 40 of them decoding
    for _ in range(20):  # most streams ended: decode steps of 10 ms, so the step has room for more prompt
        budget.decoded(0.010)
    assert 60 <= budget.tokens(running=9, prefilling=1) <= 70  # the 40 ms peak fades slowly: 2 x ~37 ms - ~11 ms
    quick = PrefillBudget(64)
    quick.prefilled(32, 0.032)
    quick.decoded(0.005)
    assert quick.tokens(running=9, prefilling=1) == 16  # 5 ms of prompt would be 5 tokens: the floor keeps prompts moving
    fixed = PrefillBudget(64, target_ms=30)
    fixed.prefilled(32, 0.032)
    fixed.decoded(0.010)
    assert fixed.tokens(running=9, prefilling=1) == 20  # --step-ms 30: 10 of decode, 20 of prompt
    scheduler = _scheduler(slots=4, chunk=256, budget=budget)
    for index in range(2):
        scheduler.add(Request(f"r{index}", [5, 6, 7], GREEDY))
    _run_prefill(scheduler)  # two streams
    scheduler.add(Request("b", list(range(1, 201)), GREEDY))
    plan = scheduler.schedule()  # two running, one prompt waiting: a share that fits the step
    share = budget.tokens(running=2, prefilling=1)
    assert 16 < share < 200 and [(c.request.id, c.start, len(c.tokens)) for c in plan.prefill] == [("b", 0, share)]
    for chunk in plan.prefill:
        scheduler.prefilled(chunk)
    scheduler.add(Request("c", list(range(300, 500)), GREEDY))  # nothing in common with b (no cached prefix)
    plan = scheduler.schedule()  # two running, two prompts waiting: the prompts go first, whole
    assert [(c.request.id, c.start, len(c.tokens)) for c in plan.prefill] == [("b", share, 200 - share), ("c", 0, 200)]


def test_a_mixed_call_charges_its_prompt_tokens_what_is_left_after_a_decode_call() -> None:
    budget = PrefillBudget(256)
    budget.mixed(64, 0.100)  # no decode call measured yet: nothing to split the time by
    assert budget.seconds_per_token is None
    budget.decoded(0.040)
    budget.mixed(60, 0.100)  # 100 ms for 60 prompt tokens and the rows: 60 ms is the prompt's, at most
    assert budget.seconds_per_token == pytest.approx(0.001)
    budget.mixed(60, 0.030)  # quicker than a decode call alone: no share to learn from
    assert budget.seconds_per_token == pytest.approx(0.001)
    assert budget.decode_seconds == pytest.approx(0.040)  # the decode rows' own cost is not measured in a mixed call


def test_beside_a_chunk_its_slots_decode_row_writes_just_past_the_chunk() -> None:
    scheduler = _scheduler(slots=3, chunk=4)
    a, x, c = (Request(name, [5, 6, 7], GREEDY) for name in "axc")
    b = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], GREEDY)
    for request in (a, x, c):
        scheduler.add(request)
    _run_prefill(scheduler)
    a.next_token, c.next_token = 11, 13
    scheduler.finish(x)
    scheduler.add(b)
    first = scheduler.schedule().prefill[0]  # b's first 4 tokens, in slot 1, between two streams
    scheduler.prefilled(first)
    chunk = scheduler.schedule().prefill[0]  # tokens 4..7
    plan = scheduler.decode_plan(beside=chunk)
    assert plan is not None and b.slot == 1 and (chunk.start, len(chunk.tokens)) == (4, 4)
    assert plan.tokens == [11, 0, 13] and plan.positions == [3, 8, 3]  # not row 4, which the chunk writes in the same call


def _brute_force_worth(pieces: list[int]) -> int:
    """The most any cut of ``pieces`` into consecutive groups is worth, by trying every cut (the reference)."""
    best = 0
    for cuts in itertools.product((False, True), repeat=max(len(pieces) - 1, 0)):
        groups, start = [], 0
        for index, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(pieces[start:index])
                start = index
        groups.append(pieces[start:])
        worth = 0
        for group in groups:
            width = min(group)
            value = sum(width - (CALL_COST if piece > width else 0) for piece in group) - CALL_COST
            if len(group) >= 2 and width >= 2 and value > 0:
                worth += value
        best = max(best, worth)
    return best


def test_grouping_fresh_prompts_is_the_best_cut_by_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        pieces = [rng.choice([1, 2, 5, 20, 48, 64, 64, 64, 100]) for _ in range(rng.randint(1, 9))]
        groups = _grouped(pieces)
        assert all(end - first >= 2 for first, end in groups)
        assert all(a_end <= b_first for (_, a_end), (b_first, _) in itertools.pairwise(groups))  # in order, disjoint
        worth = sum(
            sum(min(pieces[a:b]) - (CALL_COST if p > min(pieces[a:b]) else 0) for p in pieces[a:b]) - CALL_COST
            for a, b in groups
        )
        assert worth == _brute_force_worth(pieces), pieces
    assert _grouped([128] * 16) == [(0, 16)]  # one call, not pairs: each call costs
    assert _grouped([5] + [128] * 15) == [(1, 16)]  # a short prompt is not allowed to cut every row to 5


def test_a_burst_of_fresh_prompts_shares_calls_and_the_rest_goes_on_at_batch_one() -> None:
    ticks = itertools.count()
    table = SlotTable(6, clock=lambda: float(next(ticks)))
    scheduler = Scheduler(table, budget=PrefillBudget(32, burst=200), max_queue=8, capacity=64, batch_prompts=True)
    lengths = [20, 20, 40, 3, 20, 20]
    requests = [Request(f"r{i}", list(range(1, 1 + n)), GREEDY) for i, n in enumerate(lengths)]
    scheduler.add_all(requests)
    plan = scheduler.schedule()
    batches = [call for call in plan.prefill if isinstance(call, PrefillBatch)]
    chunks = [call for call in plan.prefill if isinstance(call, PrefillChunk)]
    assert plan.prefill[: len(batches)] == batches  # the shared calls first: the pieces after them need their rows
    # slots 0-2 share a call of 20 tokens a row (r2 cut short), r3's 3 tokens run alone, slots 4-5 share one
    assert [(b.first, [c.request.id for c in b.chunks], len(b.chunks[0].tokens)) for b in batches] == [
        (0, ["r0", "r1", "r2"], 20),
        (4, ["r4", "r5"], 20),
    ]
    assert all(c.start == 0 and c.tokens == c.request.prompt[:20] for b in batches for c in b.chunks)
    assert [(c.request.id, c.start, len(c.tokens)) for c in chunks] == [("r2", 20, 20), ("r3", 0, 3)]
    for call in plan.prefill:
        for chunk in call.chunks if isinstance(call, PrefillBatch) else [call]:
            scheduler.prefilled(chunk)
    assert all(r.status is Status.RUNNING for r in requests)
    assert [table.length(r.slot) for r in requests] == lengths


@pytest.mark.parametrize("after_past", [False, True])
def test_a_bursts_later_pieces_share_calls_where_the_runner_takes_rows_after_a_past(after_past: bool) -> None:
    """Four 64-token prompts in pieces of 16 and a 40-token one: the first pieces share a call; with ``batch_after_past``
    the pieces after each round's pasts do too, round after round within the step's budget, the 40-token prompt in
    them until its rest is short, and what no other row shares goes on at batch 1."""
    table = SlotTable(6)
    scheduler = Scheduler(
        table, budget=PrefillBudget(16, burst=4096), max_queue=8, capacity=64, batch_prompts=True, batch_after_past=after_past
    )
    requests = [Request(f"r{i}", [30 + i] * n, GREEDY) for i, n in enumerate([64, 64, 64, 64, 40])]
    scheduler.add_all(requests)
    plan = scheduler.schedule()
    shared = [
        ([c.request.id for c in call.chunks], call.start, len(call.chunks[0].tokens)) for call in plan.prefill if isinstance(call, PrefillBatch)
    ]
    alone = [(c.request.id, c.start, len(c.tokens)) for c in plan.prefill if isinstance(c, PrefillChunk)]
    rows = ["r0", "r1", "r2", "r3", "r4"]
    if after_past:
        assert shared == [(rows, 0, 16), (rows, 16, 16), (rows[:4], 32, 16), (rows[:4], 48, 16)]
        assert alone == [("r4", 32, 8)]
        assert all(c.start == call.start for call in plan.prefill if isinstance(call, PrefillBatch) for c in call.chunks)
    else:
        assert shared == [(rows, 0, 16)]
        assert alone == [(f"r{i}", start, 16) for i in range(4) for start in (16, 32, 48)] + [("r4", 16, 16), ("r4", 32, 8)]
    for call in plan.prefill:
        for chunk in call.chunks if isinstance(call, PrefillBatch) else [call]:
            assert chunk.tokens == chunk.request.prompt[chunk.start : chunk.start + len(chunk.tokens)]
            scheduler.prefilled(chunk)
    assert all(r.status is Status.RUNNING for r in requests)
    assert [table.length(r.slot) for r in requests] == [64, 64, 64, 64, 40]


def test_pieces_after_pasts_of_different_lengths_share_no_call() -> None:
    table = SlotTable(4)
    scheduler = Scheduler(table, budget=PrefillBudget(16, burst=32), max_queue=8, capacity=64, batch_prompts=True, batch_after_past=True)
    requests = [Request(f"r{i}", [40 + i] * 48, GREEDY) for i in range(2)]
    scheduler.add_all(requests)
    first = scheduler.schedule()  # 32 tokens: the two first pieces in one call
    assert [type(call) for call in first.prefill] == [PrefillBatch]
    for chunk in first.prefill[0].chunks:
        scheduler.prefilled(chunk)
    scheduler.prefilled(PrefillChunk(requests[1], 16, requests[1].prompt[16:24]))  # as if r1 had gone on alone
    plan = scheduler.schedule()  # r0 holds 16 tokens, r1 24: no shared call
    assert plan.prefill and all(isinstance(c, PrefillChunk) for c in plan.prefill)
    assert [(c.request.id, c.start) for c in plan.prefill] == [("r0", 16), ("r0", 32)]  # the oldest first, at batch 1


def test_a_shared_call_takes_only_fresh_prompts_and_the_rows_its_budget_holds() -> None:
    ticks = itertools.count()
    table = SlotTable(4, clock=lambda: float(next(ticks)))
    scheduler = Scheduler(table, budget=PrefillBudget(16, burst=40), max_queue=8, capacity=64, batch_prompts=True)
    cached = Request("cached", list(range(1, 17)), GREEDY)
    scheduler.add(cached)
    _run_prefill(scheduler)
    scheduler.finish(cached)  # its rows stay in slot 0
    reuse = Request("reuse", [*range(1, 13), 90, 91, 92, 93], GREEDY)  # 12 tokens cached: not fresh
    fresh = [Request(f"f{i}", [50 + i] * 16, GREEDY) for i in range(3)]
    scheduler.add_all([reuse, *fresh])
    plan = scheduler.schedule()
    (batch,) = [call for call in plan.prefill if isinstance(call, PrefillBatch)]
    # 40 tokens: two fresh rows of 16 in one call, then 8 more tokens at batch 1 (the oldest first)
    assert [c.request.id for c in batch.chunks] == ["f0", "f1"] and batch.first == fresh[0].slot
    rest = [(c.request.id, c.start, len(c.tokens)) for c in plan.prefill if isinstance(c, PrefillChunk)]
    assert rest == [("reuse", 12, 4), ("f2", 0, 4)]


def test_a_burst_over_the_token_cap_shares_several_calls_of_even_rows() -> None:
    table = SlotTable(8)
    scheduler = Scheduler(table, budget=PrefillBudget(16, burst=4096), max_queue=8, capacity=64, batch_prompts=True, batch_tokens=64)
    fresh = [Request(f"f{i}", [50 + i] * 16, GREEDY) for i in range(7)]
    scheduler.add_all(fresh)
    plan = scheduler.schedule()
    # 7 rows of 16 tokens, at most 4 rows a call: two calls of 4 and 3 rows
    assert [[c.request.id for c in call.chunks] for call in plan.prefill if isinstance(call, PrefillBatch)] == [
        ["f0", "f1", "f2", "f3"],
        ["f4", "f5", "f6"],
    ]
    assert not [call for call in plan.prefill if isinstance(call, PrefillChunk)]
    for call in plan.prefill:
        for chunk in call.chunks:
            scheduler.prefilled(chunk)
    assert all(r.status is Status.RUNNING for r in fresh)
    assert [table.length(r.slot) for r in fresh] == [16] * 7

    table = SlotTable(5)
    scheduler = Scheduler(table, budget=PrefillBudget(16, burst=4096), max_queue=8, capacity=64, batch_prompts=True, batch_tokens=32)
    scheduler.add_all([Request(f"g{i}", [60 + i] * 16, GREEDY) for i in range(5)])
    plan = scheduler.schedule()
    # two rows a call: 2, 2 and the last row at batch 1
    shared = [[c.request.id for c in call.chunks] for call in plan.prefill if isinstance(call, PrefillBatch)]
    assert shared == [["g0", "g1"], ["g2", "g3"]]
    assert [(c.request.id, c.start, len(c.tokens)) for c in plan.prefill if isinstance(c, PrefillChunk)] == [("g4", 0, 16)]


def test_a_group_the_budget_cannot_hold_is_left_to_later_steps() -> None:
    table = SlotTable(6)
    scheduler = Scheduler(table, budget=PrefillBudget(16, burst=32), max_queue=8, capacity=64, batch_prompts=True)
    requests = [Request(f"r{i}", [40 + i] * length, GREEDY) for i, length in enumerate([20, 32, 16, 12, 12, 4])]
    scheduler.add_all(requests)
    plan = scheduler.schedule()  # the first group takes the 32 tokens; the next gets no row (it once divided by zero)
    tokens = sum(len(c.tokens) for call in plan.prefill for c in (call.chunks if isinstance(call, PrefillBatch) else [call]))
    assert 0 < tokens <= 32


def test_a_shared_call_stays_within_its_token_cap_and_only_a_burst_shares_calls() -> None:
    ticks = itertools.count()
    table = SlotTable(5, clock=lambda: float(next(ticks)))
    scheduler = Scheduler(table, budget=PrefillBudget(64, burst=400), max_queue=8, capacity=64, batch_prompts=True, batch_tokens=40)
    fresh = [Request(f"f{i}", [50 + i] * 16, GREEDY) for i in range(3)]
    scheduler.add_all(fresh)
    plan = scheduler.schedule()
    (batch,) = [call for call in plan.prefill if isinstance(call, PrefillBatch)]
    assert [c.request.id for c in batch.chunks] == ["f0", "f1"]  # 40 tokens hold two rows of 16
    assert [(c.request.id, c.start) for c in plan.prefill if isinstance(c, PrefillChunk)] == [("f2", 0)]
    for call in plan.prefill:
        for chunk in call.chunks if isinstance(call, PrefillBatch) else [call]:
            scheduler.prefilled(chunk)
    # three streams run, two fresh prompts wait: not a burst, so each goes at batch 1, the oldest first
    late = [Request(f"late{i}", [70 + i] * 16, GREEDY) for i in range(2)]
    scheduler.add_all(late)
    plan = scheduler.schedule()
    assert plan.prefill and all(isinstance(call, PrefillChunk) for call in plan.prefill)
    assert plan.prefill[0].request is late[0]


# ---------------------------------------------------------------- one step, one call


@dataclasses.dataclass
class _Ran:
    """What a runner would report of a call (``Ran``)."""

    seconds: float = 0.01
    drafts: list[int] = dataclasses.field(default_factory=list)
    kept: int = 0
    error: str | None = None


@dataclasses.dataclass
class _Ended:
    request_id: str
    reason: str


@dataclasses.dataclass
class _Outputs:
    """What an output processor would hand back (``Outputs``)."""

    tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    finished: list[_Ended] = dataclasses.field(default_factory=list)

    @property
    def generated(self) -> int:
        return sum(len(tokens) for tokens in self.tokens.values())


def test_a_round_hands_out_one_call_a_step_and_its_decode_call_ends_it() -> None:
    """The engine's steps, without a model: each plan is run (here: a token per finished prompt) and handed back."""
    scheduler = _scheduler(slots=2, chunk=8)
    a, b = Request("a", list(range(1, 13)), GREEDY), Request("b", [40, 41, 42], GREEDY)
    scheduler.add(a)
    first = scheduler.next_call()
    assert first is not None and first.start is not None and [r.id for r, _ in first.start.admitted] == ["a"]
    assert isinstance(first.call, PrefillChunk) and (first.call.start, len(first.call.tokens)) == (0, 8)
    assert first.chunks == (first.call,) and first.decode is None
    scheduler.update_from_output(first, _Ran(), _Outputs())
    assert a.prefilled == 8 and scheduler.stats().prompt_tokens == 8
    assert scheduler.next_call() is None  # nothing runs yet: the round ends with no decode call
    scheduler.add(b)
    second = scheduler.next_call()  # a new round: b is admitted, a's rest and b's prompt share its budget
    assert second is not None and second.start is not None and [r.id for r, _ in second.start.admitted] == ["b"]
    assert isinstance(second.call, PrefillChunk) and second.call.request is a and second.call.last
    scheduler.update_from_output(second, _Ran(), _Outputs(tokens={"a": [7]}))
    assert a.status is Status.RUNNING and a.next_token == 7
    third = scheduler.next_call()  # no start: the same round's next call
    assert third is not None and third.start is None and isinstance(third.call, PrefillChunk) and third.call.request is b
    scheduler.update_from_output(third, _Ran(), _Outputs(tokens={"b": [9]}))
    decode = scheduler.next_call()
    assert decode is not None and isinstance(decode.call, DecodePlan) and decode.decode is decode.call
    assert decode.call.tokens == [7, 9] and decode.call.positions == [12, 3]
    scheduler.update_from_output(decode, _Ran(), _Outputs(tokens={"a": [8], "b": [10]}, finished=[_Ended("b", "stop")]))
    stats = scheduler.stats()
    assert (stats.steps, stats.generated_tokens, stats.prompt_tokens, stats.finished) == (1, 4, 15, {"stop": 1})
    assert b.status is Status.FINISHED and scheduler.next_call() is not None  # a new round: a's next decode call


def test_a_round_that_ends_cancelled_requests_runs_no_call_on_that_step() -> None:
    """So the requests have ended (their outputs handed back) before the round's decode call is planned without them."""
    scheduler = _scheduler(slots=2, chunk=8)
    a, b = Request("a", [1, 2, 3], GREEDY), Request("b", [4, 5, 6], GREEDY)
    for request in (a, b):
        scheduler.add(request)
    plan = scheduler.next_call()
    assert plan is not None and plan.call is not None
    scheduler.update_from_output(plan, _Ran(), _Outputs(tokens={"a": [7]}))
    plan = scheduler.next_call()
    assert plan is not None and plan.call is not None
    scheduler.update_from_output(plan, _Ran(), _Outputs(tokens={"b": [8]}))
    plan = scheduler.next_call()
    assert plan is not None and isinstance(plan.call, DecodePlan)
    scheduler.update_from_output(plan, _Ran(), _Outputs(tokens={"a": [9], "b": [10]}))
    a.cancel()
    start = scheduler.next_call()
    assert start is not None and start.start is not None and start.start.cancelled == [a] and start.call is None
    scheduler.update_from_output(start, None, _Outputs(finished=[_Ended("a", "cancelled")]))
    decode = scheduler.next_call()
    assert decode is not None and isinstance(decode.call, DecodePlan) and decode.call.requests == [b]
