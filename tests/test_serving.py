"""The continuous-batching engine and ``kvexport serve``, against the Generator run alone.

The engine is judged by the Generator's tokens for each prompt alone (itself checked
against PyTorch in test_runtime); the server by the ``openai`` client, raw HTTP and SSE,
and a real ``kvexport serve`` process stopped with SIGTERM. Servers listen on 127.0.0.1,
on a free port; every load loop is bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from kvexport import KvexportError
from kvexport.runtime import Generator
from kvexport.serving import Engine, EngineFull, SamplingParams
from kvexport.serving.config import ApiConfig
from kvexport.serving.output import RequestState
from kvexport.testing import app_in_thread
from tests.conftest import TRAINED

# the engine's tokens equal the Generator's over an fp32 cache with decode calls on the export's blocks; a quantized
# export's defaults (an fp16 pool, decode calls of 16+ rows in bf16) are judged in tests/test_paged_cache.py
EXACT: dict[str, object] = {"kv_cache_dtype": "fp32", "bf16_decode_rows": 0}
HELDOUT_IDS = Tokenizer.from_file(str(TRAINED / "tokenizer.json")).encode((TRAINED / "heldout.txt").read_text()).ids


def _prompts(count: int, shortest: int = 2, longest: int = 120, seed: int = 0) -> list[list[int]]:
    """Windows of the held-out text, each of its own length."""
    rng = random.Random(seed)
    lengths = np.linspace(shortest, longest, count).astype(int).tolist()
    prompts = []
    for length in lengths:
        start = rng.randrange(0, len(HELDOUT_IDS) - length)
        prompts.append(HELDOUT_IDS[start : start + length])
    return prompts


@pytest.mark.parametrize("scheme", ["none", "int8", "int8-pc", "kv-int8"])
def test_sixteen_greedy_requests_at_once_give_each_prompts_own_tokens(trained_exports: dict[str, Path], scheme: str) -> None:
    export = trained_exports[scheme]
    prompts = _prompts(16)
    alone = Generator(export)
    want = [alone.generate([p], 24, eos_token_id=-1)[0, len(p) :].tolist() for p in prompts]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    exact = {} if scheme == "kv-int8" else EXACT  # an 8-bit cache stays in slots, in its own dtype
    with Engine(export, slots=16, max_context=160, chunk=48, **exact) as engine:
        handles = engine.submit_all([(p, greedy) for p in prompts])  # all at once: one step admits them all
        got = [h.result() for h in handles]
        stats = engine.stats()
    assert [tokens for tokens, _, _ in got] == want
    # pieces of 2, 9, 17, 25, 33, 41 and ten of 48 tokens: 17+25, 33+41 and the ten 48s shared calls; with the 8-bit
    # cache the ten's second pieces (after pasts of 48) share calls too
    assert stats.batched_prompts == 14 and (stats.batched_pieces > 0) == (scheme == "kv-int8")
    assert {reason for _, _, reason in got} == {"length"}
    assert stats.slots_in_use == 0 and stats.waiting == 0 and stats.finished == {"length": 16}
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    # the 16 rows decoded together: far fewer batched steps than tokens generated
    assert stats.generated_tokens == 16 * 24 and stats.steps < 16 * 24 / 4


@pytest.mark.parametrize("scheme", ["none", "int8", "int8-pc"])
def test_a_long_prompt_arriving_while_others_decode_changes_no_tokens(trained_exports: dict[str, Path], scheme: str) -> None:
    export = trained_exports[scheme]
    short, long = _prompts(3, shortest=5, longest=20, seed=3), _prompts(1, shortest=200, longest=200, seed=4)[0]
    alone = Generator(export)
    want = [alone.generate([p], 64, eos_token_id=-1)[0, len(p) :].tolist() for p in short]
    want.append(alone.generate([long], 16, eos_token_id=-1)[0, len(long) :].tolist())
    with Engine(export, slots=4, max_context=240, chunk=24, **EXACT) as engine:  # the long prompt takes 9 chunks
        running = [engine.submit(p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)) for p in short]
        streams = [iter(handle) for handle in running]
        early = [[next(stream).token_id for _ in range(4)] for stream in streams]  # all decoding now
        late = engine.submit(long, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        late_events = iter(late)
        first = next(late_events)
        # the long prompt's chunks ran between the others' decode steps: they were still decoding
        assert all(handle.completion_tokens < 64 for handle in running)
        got = [head + [event.token_id for event in stream] for head, stream in zip(early, streams, strict=True)]
        got.append([first.token_id] + [event.token_id for event in late_events])
    assert got == want


def test_requests_reaching_an_idle_engine_one_by_one_are_gathered_into_one_prefill_call(trained_exports: dict[str, Path]) -> None:
    export = trained_exports["int8-pc"]
    prompts = [HELDOUT_IDS[start : start + 40] for start in (100, 900, 1700)]
    alone = Generator(export)
    want = [alone.generate([p], 8, eos_token_id=-1)[0, len(p) :].tolist() for p in prompts]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with Engine(export, slots=4, max_context=96, gather_ms=500, **EXACT) as engine:
        handles = []
        for prompt in prompts:  # one by one, 50 ms apart, as a server's requests may come: each within the gap
            handles.append(engine.submit(prompt, greedy))
            time.sleep(0.05)
        got = [h.result()[0] for h in handles]
        stats = engine.stats()
    assert got == want and stats.batched_prompts == 3


def test_requests_arriving_during_a_bursts_step_join_its_next_shared_call(trained_exports: dict[str, Path]) -> None:
    """Four 48-token prompts plan a step of one shared call (their first 16 tokens) and eight calls at batch 1. Four
    more arrive while the shared call runs: the step ends there, and the next shares their first pieces at once,
    before the first four's rest. Every request keeps its own tokens."""
    export = trained_exports["int8-pc"]
    early = [HELDOUT_IDS[start : start + 48] for start in (100, 700, 1300, 1900)]
    late = [HELDOUT_IDS[start : start + 16] for start in (2500, 3100, 3700, 4300)]
    alone = Generator(export)
    want = [alone.generate([p], 6, eos_token_id=-1)[0, len(p) :].tolist() for p in early + late]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with Engine(export, slots=8, max_context=96, chunk=16, batch_tokens=64, **EXACT) as engine:
        calls: list[tuple[str, int, int]] = []  # (kind, first slot, start), in the order they ran
        run_rows, run_piece = engine.runner.run_rows, engine.runner.run_piece
        late_handles: list[Any] = []

        def rows(first: int, pieces: Sequence[Sequence[int]], start: int = 0) -> np.ndarray:
            calls.append(("rows", first, start))
            logits = run_rows(first, pieces, start)
            if first == 0 and not late_handles:  # the burst's first call has run: the others arrive
                late_handles.extend(engine.submit_all([(p, greedy) for p in late]))
            return logits

        def piece(slot: int, tokens: Sequence[int], start: int) -> np.ndarray:
            calls.append(("piece", slot, start))
            return run_piece(slot, tokens, start)

        engine.runner.run_rows, engine.runner.run_piece = rows, piece  # type: ignore[method-assign]
        got = [h.result()[0] for h in engine.submit_all([(p, greedy) for p in early])]
        got += [h.result()[0] for h in late_handles]  # submitted before the first four's first call returned
        stats = engine.stats()
    assert got == want and stats.batched_prompts == 8
    # planned together, the first four's rest would have run before the late four's shared call
    assert calls[:3] == [("rows", 0, 0), ("rows", 4, 0), ("piece", 0, 16)]


def test_more_requests_than_slots_queue_and_keep_their_tokens(trained_exports: dict[str, Path]) -> None:
    export = trained_exports["none"]
    prompts = _prompts(7, longest=70, seed=1)
    alone = Generator(export)
    want = [alone.generate([p], 12, eos_token_id=-1)[0, len(p) :].tolist() for p in prompts]
    with Engine(export, slots=3, max_context=96, chunk=16) as engine:  # prompts over 16 tokens prefill in chunks
        handles = [engine.submit(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for p in prompts]
        assert [h.result()[0] for h in handles] == want


def test_sampling_follows_each_requests_seed_whatever_runs_beside_it(trained_exports: dict[str, Path]) -> None:
    prompt = _prompts(1, 10, 10)[0]
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    with Engine(trained_exports["none"], slots=4, max_context=64) as engine:
        alone = engine.submit(prompt, sampled).result()[0]
        others = [engine.submit(p, SamplingParams(max_tokens=16, temperature=1.0, seed=i)) for i, p in enumerate(_prompts(3, seed=2, longest=40))]
        together = engine.submit(prompt, sampled).result()[0]
        for handle in others:
            handle.result()
        other_seed = engine.submit(prompt, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=8, ignore_eos=True)).result()[0]
    assert together == alone
    assert other_seed != alone


def _alone(export: Path, prompt: list[int], tokens: int) -> list[int]:
    return Generator(export).generate([prompt], tokens, eos_token_id=-1)[0, len(prompt) :].tolist()


def test_a_cached_prefix_is_reused_in_place_and_changes_no_tokens(trained_exports: dict[str, Path]) -> None:
    export = trained_exports["none"]
    shared = HELDOUT_IDS[100:160]
    first, second = shared + HELDOUT_IDS[400:410], shared + HELDOUT_IDS[700:712]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with Engine(export, slots=4, max_context=128) as engine:
        one = engine.submit(first, greedy)
        got_first = one.result()[0]
        # a chat-like follow-up: the first prompt, its answer and more; rows written by
        # decode steps are reused as well (the last answer token was never fed)
        follow = first + got_first + HELDOUT_IDS[900:905]
        three = engine.submit(follow, greedy)
        got_follow = three.result()[0]
        two = engine.submit(second, greedy)  # shares only the first 60 tokens
        got_second = two.result()[0]
        stats = engine.stats()
    assert (one.cached_tokens, two.cached_tokens) == (0, len(shared))
    assert three.cached_tokens == len(first) + len(got_first) - 1
    assert got_first == _alone(export, first, 8) and got_second == _alone(export, second, 8)
    assert got_follow == _alone(export, follow, 8)
    assert stats.prefix_hits == 2 and stats.cached_tokens == two.cached_tokens + three.cached_tokens
    assert stats.prompt_tokens + stats.cached_tokens == len(first) + len(second) + len(follow)


def test_a_prefix_cached_in_a_busy_slot_is_copied_and_registered_prefixes_stay(trained_exports: dict[str, Path]) -> None:
    export = trained_exports["none"]
    shared = HELDOUT_IDS[200:250]
    long_running = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [shared + HELDOUT_IDS[500 + 20 * i : 507 + 20 * i] for i in range(3)]
    with Engine(export, slots=4, max_context=128, chunk=64) as engine:
        busy = engine.submit(prompts[0], long_running)
        next(iter(busy))  # its prompt is in slot 0 and it keeps decoding
        copied = engine.submit(prompts[1], greedy)  # slot 1, rows copied from slot 0
        got_copied = copied.result()[0]
        busy.cancel()
        busy.result()
        assert engine.register_prefix(shared) == len(shared)
        assert engine.stats().pinned == 1
        for _ in range(2):  # fill the low slots with other text, then come back to the prefix
            engine.submit(HELDOUT_IDS[1000:1030], greedy).result()
        registered = engine.submit(prompts[2], greedy)
        got_registered = registered.result()[0]
        assert engine.unregister_prefix(shared) and not engine.unregister_prefix(shared)
        assert engine.stats().pinned == 0
    assert copied.cached_tokens == len(shared) and registered.cached_tokens == len(shared)
    assert got_copied == _alone(export, prompts[1], 6) and got_registered == _alone(export, prompts[2], 6)


def test_without_the_prefix_cache_every_prompt_is_prefilled(trained_exports: dict[str, Path]) -> None:
    prompt = HELDOUT_IDS[300:340]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with Engine(trained_exports["none"], slots=2, max_context=64, prefix_cache=False) as engine:
        handles = [engine.submit(prompt, greedy) for _ in range(2)]
        for handle in handles:
            handle.result()
        with pytest.raises(KvexportError, match="registered prefixes need the prefix cache"):
            engine.register_prefix(prompt)
        assert engine.stats().cached_tokens == 0 and engine.stats().prompt_tokens == 2 * len(prompt)


def test_a_listener_that_raises_ends_the_requests_it_saw_and_the_engine_serves_on(trained_exports: dict[str, Path]) -> None:
    import threading

    class Faulty:
        raised = False

        def on_first_token(self, seconds: float) -> None:
            if not Faulty.raised:
                Faulty.raised = True
                raise RuntimeError("a metrics bug")

        def on_token(self, seconds: float) -> None:
            pass

        def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
            pass

    def within_a_minute(handle: RequestState) -> tuple[list[int], str, str] | None:
        ended: list[tuple[list[int], str, str]] = []
        waiter = threading.Thread(target=lambda: ended.append(handle.result()), daemon=True)
        waiter.start()
        waiter.join(60)
        return ended[0] if ended else None  # None: the engine's thread is gone

    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with Engine(trained_exports["none"], slots=2, max_context=64) as engine:
        engine.add_listener(Faulty())
        first = within_a_minute(engine.submit(HELDOUT_IDS[:20], greedy))
        assert first is not None and first[2] == "error"
        after = within_a_minute(engine.submit(HELDOUT_IDS[:20], greedy))
        assert after is not None and after[2] == "length" and len(after[0]) == 4


def test_stop_strings_end_the_text_before_them(trained_exports: dict[str, Path]) -> None:
    prompt = _prompts(1, 20, 20, seed=3)[0]
    with Engine(trained_exports["none"], slots=2, max_context=96) as engine:
        _, text, reason = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)).result()
        assert reason == "length" and len(text) > 20
        stop = text[12:16]
        before = text[: text.index(stop)]
        pieces = [e.text for e in engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, stop=(stop, "\x00never"), ignore_eos=True))]
    assert "".join(pieces) == before
    assert stop not in "".join(pieces)


def test_eos_ends_a_request_unless_ignored(trained_exports: dict[str, Path], tmp_path: Path) -> None:
    prompt = _prompts(1, 12, 12, seed=4)[0]
    greedy = Generator(trained_exports["none"]).generate([prompt], 6, eos_token_id=-1)[0, len(prompt) :].tolist()
    # a copy whose manifest names the third greedy token as EOS
    export = Path(shutil.copytree(trained_exports["none"], tmp_path / "export"))
    manifest = json.loads((export / "kvexport.json").read_text())
    manifest["tokenizer"]["eos_token_id"] = eos = greedy[2]
    (export / "kvexport.json").write_text(json.dumps(manifest))
    stop_at = greedy.index(eos) + 1
    with Engine(export, slots=2, max_context=64) as engine:
        tokens, _, reason = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0)).result()
        assert (tokens, reason) == (greedy[:stop_at], "stop")
        tokens, _, reason = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)).result()
        assert (tokens, reason) == (greedy, "length")


def test_cancel_frees_the_slot_and_a_full_queue_refuses(trained_exports: dict[str, Path]) -> None:
    with Engine(trained_exports["none"], slots=1, max_context=200, max_queue=1) as engine:
        long = SamplingParams(max_tokens=190, temperature=0, ignore_eos=True)
        running = engine.submit([5, 6, 7], long)
        waiting = engine.submit([5, 6, 7], long)
        with pytest.raises(EngineFull, match="requests are waiting for a slot; retry shortly$"):
            engine.submit([5, 6, 7], long)
        next(iter(running))  # it has a slot and streams
        running.cancel()
        assert [e.finish_reason for e in running][-1] == "cancelled"
        first = next(iter(waiting))  # the freed slot went to the waiting request
        assert first.token_id is not None
        waiting.cancel()
        deadline = time.monotonic() + 5
        while engine.stats().slots_in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats().slots_in_use == 0
        assert engine.stats().finished.get("cancelled") == 2


def test_requests_sent_during_a_step_wait_in_the_input_queue_and_the_step_thread_takes_no_callers_lock(
    trained_exports: dict[str, Path],
) -> None:
    """Callers reach the step thread through its input queue (vLLM's EngineCore input queue): requests sent while a
    step runs count against the queue's bound before the step thread has taken them, a cancelled one no more, at once;
    and the step thread finishes requests while a caller holds the senders' lock (it never takes it)."""
    export = trained_exports["none"]
    prompt = [5, 6, 7]
    want = Generator(export).generate([prompt], 6, eos_token_id=-1)[0, len(prompt) :].tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with Engine(export, slots=1, max_context=64, max_queue=1, warm_up=0, **EXACT) as engine:
        entered, release = threading.Event(), threading.Event()
        execute = engine.runner.execute

        def paused(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            assert release.wait(30), "the test never released the step"
            return execute(*args, **kwargs)

        engine.runner.execute = paused  # type: ignore[method-assign]
        first = engine.submit(prompt, greedy)
        assert entered.wait(30)  # the step thread is inside the first request's step
        second = engine.submit(prompt, greedy)  # the one place the queue has (max_queue 1, no slot free)
        with pytest.raises(EngineFull, match="^1 requests are waiting for a slot; retry shortly$"):
            engine.submit(prompt, greedy)  # the step thread has not taken the second yet: it counts all the same
        second.cancel()
        third = engine.submit(prompt, greedy)  # the cancelled one left the queue's count at once, the step still running
        engine.runner.execute = execute  # type: ignore[method-assign]
        results: list[Any] = []
        finisher = threading.Thread(target=lambda: results.extend(s.result()[0] for s in (first, third)), daemon=True)
        with engine._sending:  # a caller in the middle of sending: the step path must not wait for it
            release.set()
            finisher.start()
            finisher.join(60)
            assert not finisher.is_alive(), "the step thread waited for the senders' lock"
        assert results == [want, want]
        assert second.result()[2] == "cancelled"
        assert engine.stats().finished == {"length": 2, "cancelled": 1}


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "the prompt is empty; pass at least one token"),
        ([5, 99999], SamplingParams(), "token id 99999 is out of vocabulary (its 2048 tokens are 0..2047)"),
        (
            [5] * 60,
            SamplingParams(max_tokens=10),
            "this model's maximum context length is 64 tokens, but 70 were requested (60 in the prompt, 10 for the "
            "completion); shorten the prompt or ask for fewer tokens",
        ),
        ([5], SamplingParams(max_tokens=0), "max_tokens 0: must be a positive integer"),
        ([5], SamplingParams(top_p=0.0), "top_p 0.0: must be in (0, 1] (1 disables it)"),
    ],
)
def test_bad_requests_are_one_line(trained_exports: dict[str, Path], prompt: list[int], params: SamplingParams, message: str) -> None:
    with Engine(trained_exports["none"], slots=1, max_context=64) as engine:
        with pytest.raises(KvexportError) as caught:
            engine.submit(prompt, params)
    assert str(caught.value) == message


def test_a_concat_export_is_refused_in_one_line(tiny_export: Path) -> None:
    with pytest.raises(KvexportError) as caught:
        Engine(tiny_export)
    assert str(caught.value) == (
        f"{tiny_export}: has the concat cache layout; the engine needs the in-place cache: export with "
        "--target ort-cpu or ort-cuda (or --cache shared-buffer)"
    )


# ---------------------------------------------------------------- HTTP


@contextlib.contextmanager
def _server(
    directory: Path, api: ApiConfig | None = None, **engine_options: object
) -> Iterator[tuple[str, Engine]]:
    """The app on uvicorn in a thread, on 127.0.0.1 and a free port; the model is named "trained" unless ``api`` names it."""
    engine = Engine(directory, **engine_options)  # type: ignore[arg-type]
    api = api or ApiConfig()
    try:
        with app_in_thread(engine, dataclasses.replace(api, name=api.name or "trained")) as url:
            yield url, engine
    finally:
        engine.close(drain=False)


@pytest.fixture(scope="module")
def served(trained_exports: dict[str, Path]) -> Iterator[tuple[str, Engine]]:
    with _server(trained_exports["none"], ApiConfig(enable_prompt_tokens_details=True), slots=4, max_context=128, max_queue=8) as running:
        yield running


def _text_alone(export: Path, prompt: str, tokens: int) -> str:
    generator = Generator(export)
    ids = generator.encode(prompt)
    out = generator.generate([ids], tokens, eos_token_id=-1)[0, len(ids) :].tolist()
    assert generator.tokenizer is not None
    return generator.tokenizer.decode(out)


def test_the_openai_client_works_unchanged(served: tuple[str, Engine], trained_exports: dict[str, Path]) -> None:
    from openai import OpenAI

    url, _ = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["trained"]
    want = _text_alone(trained_exports["none"], "The help topic", 20)
    prompt_tokens = len(Generator(trained_exports["none"]).encode("The help topic"))
    done = client.completions.create(model="trained", prompt="The help topic", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].text == want and done.choices[0].finish_reason == "length"
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, 20)
    chunks = list(
        client.completions.create(
            model="trained", prompt="The help topic", max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert len([c for c in chunks if c.choices]) == 20  # one chunk per token
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == prompt_tokens + 20


def test_the_stream_is_sse_ending_in_done(served: tuple[str, Engine]) -> None:
    url, _ = served
    body = {"prompt": [5, 17, 300], "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 4
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


@pytest.mark.parametrize(
    ("request_body", "status", "message", "param"),
    [
        (b"{not json", 400, "the request body is not valid JSON; send a JSON object", None),
        ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens: Input should be a valid integer (int_type)", "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens: Input should be greater than or equal to 1 (greater_than_equal)", "max_tokens"),
        ({"prompt": "x", "temperature": 3.0}, 400, "temperature: Input should be less than or equal to 2 (less_than_equal)", "temperature"),
        ({"max_tokens": 3}, 400, "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"),
        ({"prompt": "x", "suffix": "y"}, 400, "suffix: not served by kvexport serve; leave it out", "suffix"),
        ({"prompt": "x", "best_of": 2}, 400, "best_of: not served by kvexport serve; leave it out", "best_of"),
        (
            {"prompt": [5] * 120, "max_tokens": 20},
            400,
            "this model's maximum context length is 128 tokens, but 140 were requested (120 in the prompt, 20 for "
            "the completion); shorten the prompt or ask for fewer tokens",
            "prompt",
        ),
        ({"model": "gpt-9", "prompt": "x"}, 404, "the model `gpt-9` does not exist; this server serves `trained`", "model"),
    ],
)
def test_bad_requests_get_openais_error_shape(
    served: tuple[str, Engine], request_body: object, status: int, message: str, param: str | None
) -> None:
    url, _ = served
    if isinstance(request_body, bytes):
        response = httpx.post(f"{url}/v1/completions", content=request_body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{url}/v1/completions", json=request_body)
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["message"], error["param"]) == (message, param)
    assert set(error) == {"message", "type", "param", "code"}


def test_unknown_routes_are_404_in_openais_shape(served: tuple[str, Engine]) -> None:
    url, _ = served
    response = httpx.get(f"{url}/v1/chat/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "no route GET /v1/chat/nothing; see /v1/completions, /v1/models"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def _wait_idle(engine: Engine, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while (engine.stats().slots_in_use or engine.stats().waiting) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_client_that_hangs_up_frees_its_slot(served: tuple[str, Engine]) -> None:
    url, engine = served
    before = engine.stats().finished.get("cancelled", 0)
    body = {"prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        for index, _ in enumerate(response.iter_lines()):
            if index == 3:
                break  # leave mid-stream
    steps = engine.stats().steps
    _wait_idle(engine)
    stats = engine.stats()
    assert stats.slots_in_use == 0 and stats.finished.get("cancelled", 0) == before + 1
    assert stats.steps - steps < 100  # it did not run to max_tokens


def test_metrics_count_what_was_served(served: tuple[str, Engine]) -> None:
    url, engine = served
    _wait_idle(engine)
    before = engine.stats()
    body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()  # all but its last token cached
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    cached = first["usage"]["prompt_tokens_details"]["cached_tokens"] + 5
    text = httpx.get(f"{url}/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    model = '{model="trained"}'
    assert values[f"kvexport_prompt_tokens_total{model}"] == before.prompt_tokens + 12 - cached
    assert values[f"kvexport_prefix_cache_tokens_total{model}"] == before.cached_tokens + cached
    assert values[f"kvexport_prefix_cache_hits_total{model}"] >= before.prefix_hits + 1
    assert values[f"kvexport_generation_tokens_total{model}"] == before.generated_tokens + 12
    after = engine.stats()
    assert values[f"kvexport_decode_steps_total{model}"] == after.steps
    for counter, field in (("mixed_steps", "mixed_steps"), ("spec_draft_tokens", "drafted_tokens"), ("spec_accepted_tokens", "accepted_tokens")):
        assert values[f"kvexport_{counter}_total{model}"] == getattr(after, field)
    assert values[f"kvexport_slots{model}"] == 4 and values[f"kvexport_slots_in_use{model}"] == 0
    assert values[f"kvexport_requests_running{model}"] == 0 and values[f"kvexport_requests_waiting{model}"] == 0
    assert values['kvexport_requests_total{finish_reason="length",model="trained"}'] >= 1
    assert values[f"kvexport_time_to_first_token_seconds_count{model}"] >= 1
    assert values[f"kvexport_inter_token_latency_seconds_count{model}"] >= 5
    # a list of prompts is queued at once: their first pieces share a prefill call
    pair = {"prompt": [list(range(40, 64)), list(range(70, 94))], "max_tokens": 2, "temperature": 0}  # 24 tokens each
    assert len(httpx.post(f"{url}/v1/completions", json=pair, timeout=30).json()["choices"]) == 2
    text = httpx.get(f"{url}/metrics").text
    batched = next(float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("kvexport_batched_prompts_total"))
    assert batched == engine.stats().batched_prompts == after.batched_prompts + 2


def test_a_full_queue_is_503_with_retry_after(trained_exports: dict[str, Path]) -> None:
    with _server(trained_exports["none"], slots=1, max_context=256, max_queue=1) as (url, engine):
        barrier = threading.Barrier(6)
        responses: list[httpx.Response] = []

        def client() -> None:
            barrier.wait()  # six requests at once for one slot and one place in the queue
            responses.append(httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 250, "ignore_eos": True}, timeout=60))

        threads = [threading.Thread(target=client) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        refused = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert len(refused) + len(served) == 6 and len(refused) >= 4 and len(served) >= 1
        for response in refused:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "server_overloaded"
            assert response.json()["error"]["message"].endswith("requests are waiting for a slot; retry shortly")
        assert engine.stats().finished == {"length": len(served)}


def test_a_short_soak_with_random_hang_ups_loses_nothing(served: tuple[str, Engine]) -> None:
    url, engine = served
    _wait_idle(engine)
    before = engine.stats()
    rng = random.Random(0)
    plans = [(rng.randint(1, 40), rng.random() < 0.4, rng.randint(1, 6)) for _ in range(48)]
    results: list[str] = []

    def client(plan: tuple[int, bool, int]) -> None:
        tokens, hang_up, after = plan
        body = {"prompt": HELDOUT_IDS[:5], "max_tokens": tokens, "stream": True, "ignore_eos": True, "temperature": 0.8}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            if response.status_code == 503:
                results.append("refused")
                return
            for index, line in enumerate(response.iter_lines()):
                if hang_up and index >= after:
                    results.append("hung up")
                    return
                if line == "data: [DONE]":
                    results.append("done")
                    return
        results.append("incomplete")

    threads = [threading.Thread(target=client, args=(plan,)) for plan in plans]
    for index in range(0, len(threads), 8):  # 8 clients at a time, bounded
        for thread in threads[index : index + 8]:
            thread.start()
        for thread in threads[index : index + 8]:
            thread.join(60)
    _wait_idle(engine)
    after = engine.stats()
    ended = {reason: after.finished.get(reason, 0) - before.finished.get(reason, 0) for reason in after.finished}
    assert "incomplete" not in results and len(results) == len(plans)
    accepted = len(plans) - results.count("refused")
    assert sum(ended.values()) == accepted  # every accepted request completed or was cancelled
    assert ended.get("cancelled", 0) <= results.count("hung up")
    assert after.slots_in_use == 0 and after.waiting == 0


def test_sigterm_finishes_the_running_request_and_exits_0(trained_exports: dict[str, Path]) -> None:
    command = [sys.executable, "-m", "kvexport.cli", "serve", str(trained_exports["none"]), "--port", "0", "--slots", "2", "--max-context", "200"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stderr is not None
        first = process.stderr.readline()
        assert first.startswith("kvexport: serving ") and " as 'none' on http://127.0.0.1:" in first
        url = first.split(" on ")[1].split(" ")[0]
        lines: list[str] = []
        body = {"prompt": "x", "max_tokens": 120, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            iterator = response.iter_lines()
            lines.append(next(iterator))
            process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # it takes no new connections
                httpx.get(f"{url}/health", timeout=2)
            lines += [line for line in iterator if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 121  # the running request finished
        assert process.wait(30) == 0
        rest = process.stderr.read()
        assert "shutting down: finishing the requests already admitted" in rest and "Traceback" not in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("stop", [(), ("東京",), ("sky", "\n\t")])
def test_streamed_text_is_the_decoded_text_cut_at_the_first_stop(stop: tuple[str, ...]) -> None:
    from kvexport.models.tokenizer import gpt2_tokenizer
    from kvexport.runtime.text import TextStream, text_pieces

    tokenizer = gpt2_tokenizer()
    rng = random.Random(0)
    for ids in (tokenizer.encode("naïve café — 東京 🙂 The sky is blue.\n\tend " * 3).ids, [rng.randrange(50257) for _ in range(300)]):
        whole = tokenizer.decode(ids)
        stream = TextStream(tokenizer, stop)
        pieces, stopped = [], False
        for token in ids:  # one token at a time, as the engine feeds it
            piece, stopped = stream.add(token)
            pieces.append(piece)
            if stopped:
                break
        if not stopped:
            pieces.append(stream.flush())
        cut = min((whole.find(s) for s in stop if s in whole), default=len(whole))
        assert "".join(pieces) == whole[:cut]
        # the Generators' text streams: everything up to EOS, whole characters only
        eos = ids[len(ids) // 2]
        upto = tokenizer.decode(ids[: ids.index(eos)])
        streamed = list(text_pieces(tokenizer, ids, eos))
        assert "".join(streamed) == upto
        if "\ufffd" not in upto:  # real text: no piece ends inside a character
            assert all("\ufffd" not in piece for piece in streamed)


def test_a_warm_up_that_fails_raises_in_one_line_and_leaves_no_thread_behind(trained_exports: dict[str, Path], tmp_path: Path) -> None:
    """A broken export whose graph opens but whose calls fail (its manifest claims twice the graph's vocabulary, so
    the decode call's logits do not fit): the constructor raises, and no engine thread is left running."""
    broken = tmp_path / "broken"
    shutil.copytree(trained_exports["none"], broken)
    manifest = json.loads((broken / "kvexport.json").read_text())
    manifest["model"]["dims"]["vocab_size"] *= 2
    (broken / "kvexport.json").write_text(json.dumps(manifest))
    before = set(threading.enumerate())
    with pytest.raises(KvexportError, match="warm-up failed"):
        Engine(broken, slots=2, max_context=64, warm_up=1)
    assert [t for t in threading.enumerate() if t not in before and t.name == "kvexport-engine"] == []


def test_the_warm_up_leaves_no_costs_in_the_prefill_budget(trained_exports: dict[str, Path]) -> None:
    """ONNX Runtime's cold first runs are slow: measured into the budget, they would set its decode peak for hundreds of steps."""
    with Engine(trained_exports["none"], slots=2, max_context=64, warm_up=2) as engine:
        budget = engine.scheduler.budget
        assert (budget.decode_seconds, budget.seconds_per_token, budget.decode_peak) == (None, None, 0.0)
        engine.submit([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)).result()
        assert engine.scheduler.budget.decode_seconds is not None  # measured from the first real request on


def test_the_default_cache_fits_one_gib_where_the_models_context_would_not(trained_exports: dict[str, Path]) -> None:
    from kvexport.bundle.manifest import read_manifest
    from kvexport.serving.engine import DEFAULT_KV_MEMORY, default_capacity, slot_bytes

    manifest = read_manifest(trained_exports["none"])
    per_token = slot_bytes(manifest, 1)
    # the trained model's own context fits the budget many times over: it stays whole
    assert default_capacity(manifest, 8) == manifest.dims.max_positions
    # a model with SmolLM2-135M's context and a cache 64x the trained model's per token does not
    wide = dataclasses.replace(
        manifest, dims=dataclasses.replace(manifest.dims, max_positions=8192, num_layers=manifest.dims.num_layers * 64)
    )
    capacity = default_capacity(wide, 8)
    assert capacity % 256 == 0 and 512 <= capacity < 8192
    assert 8 * slot_bytes(wide, capacity) <= DEFAULT_KV_MEMORY < 8 * slot_bytes(wide, capacity + 256)
    assert per_token * 64 == slot_bytes(wide, 1)
    # --max-context and --kv-memory size it as asked; the default alone is budgeted
    with Engine(trained_exports["none"], slots=2, max_context=64, warm_up=0) as engine:
        assert engine.capacity == 64
