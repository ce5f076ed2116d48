"""The engine's features on a Llama-family export, against PyTorch: logprobs, prompt logprobs,
the prefix cache and ``n`` samples.

The trained Llama (tests/data/tiny-trained-llama: 4 query heads sharing 2 KV heads, rotary
positions) is exported once for ort-cpu with the logits at every position, so prompt logprobs
can be served; the reference is transformers' own model on the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvexport import export_model
from kvexport.runtime.generator import Generator
from kvexport.serving import Engine, SamplingParams

TRAINED_LLAMA = Path(__file__).parent / "data" / "tiny-trained-llama"


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama-engine") / "out"
    export_model(out, str(TRAINED_LLAMA), target="ort-cpu", all_logits=True)
    return out


@pytest.fixture(scope="module")
def heldout_ids() -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TRAINED_LLAMA / "tokenizer.json"))
    return tokenizer.encode((TRAINED_LLAMA / "heldout.txt").read_text()[:20_000]).ids


@pytest.fixture(scope="module")
def torch_llama() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TRAINED_LLAMA, dtype=torch.float32).eval()


def _log_softmax(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """PyTorch's log-probabilities after every position of ``ids``: [len, V] float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def _alone(export: Path, prompt: list[int], tokens: int) -> list[int]:
    return Generator(export).generate([prompt], tokens, eos_token_id=-1)[0, len(prompt) :].tolist()


def test_logprobs_and_prompt_logprobs_are_pytorchs(llama_export: Path, torch_llama: torch.nn.Module, heldout_ids: list[int]) -> None:
    prompt = heldout_ids[100:140]  # 40 tokens over chunks of 16: prompt logprobs span three prefill steps
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    with Engine(llama_export, slots=2, max_context=64, chunk=16) as engine:
        request = engine.submit(prompt, params)
        events = list(request)
    tokens = [e.token_id for e in events]
    reference = _log_softmax(torch_llama, prompt + tokens[:-1])
    for step, event in enumerate(events):  # the generated tokens
        row = reference[len(prompt) - 1 + step]
        assert event.logprob is not None and event.logprob.token_id == tokens[step] == int(np.argmax(row))
        assert abs(event.logprob.logprob - row[tokens[step]]) < 2e-4
        assert [t for t, _ in event.logprob.top] == np.argsort(-row)[:4].tolist()
        np.testing.assert_allclose([v for _, v in event.logprob.top], row[np.argsort(-row)[:4]], atol=2e-4)
    assert request.prompt_logprobs[0] is None and len(request.prompt_logprobs) == len(prompt)
    for position, logprob in enumerate(request.prompt_logprobs[1:], start=1):
        row = reference[position - 1]
        assert logprob is not None and logprob.token_id == prompt[position]
        assert abs(logprob.logprob - row[prompt[position]]) < 2e-4
        assert logprob.rank == int((row > row[prompt[position]]).sum()) + 1


def test_a_cached_prefix_and_n_samples_change_no_tokens(llama_export: Path, heldout_ids: list[int]) -> None:
    shared = heldout_ids[200:240]
    first, second = shared + heldout_ids[400:410], shared + heldout_ids[700:706]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    with Engine(llama_export, slots=4, max_context=64) as engine:
        one = engine.submit(first, greedy)
        got_first = one.result()[0]
        two = engine.submit(second, greedy)  # its first 40 tokens' rows are reused, rotary positions and all
        got_second = two.result()[0]
        together = engine.submit_n(second, sampled, 3)
        got_n = [r.result()[0] for r in together]
        alone = [engine.submit(second, SamplingParams(max_tokens=8, temperature=1.0, seed=5 + i, ignore_eos=True)).result()[0] for i in range(3)]
    assert (one.cached_tokens, two.cached_tokens) == (0, len(shared))
    assert got_first == _alone(llama_export, first, 8) and got_second == _alone(llama_export, second, 8)
    assert got_n == alone and len({tuple(t) for t in got_n}) == 3
    assert [r.cached_tokens for r in together][1:] == [len(second) - 1] * 2  # prefilled once, rows copied


def test_prompts_sent_together_share_a_prefill_call_and_keep_pytorchs_numbers(
    llama_export: Path, torch_llama: torch.nn.Module, heldout_ids: list[int]
) -> None:
    # 40, 40 and 24 tokens in chunks of 16: one call prefills the three first pieces (no past), the rest goes on at batch 1
    prompts = [heldout_ids[1000:1040], heldout_ids[2000:2040], heldout_ids[3000:3024]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    results = {}
    # one shared call; calls of at most 32 tokens (two rows, then the third alone); a call each
    for label, settings in {"shared": {}, "split": {"batch_tokens": 32}, "alone": {"batch_prompts": False}}.items():
        with Engine(llama_export, slots=4, max_context=64, chunk=16, **settings) as engine:
            requests = engine.submit_all([(prompt, params) for prompt in prompts])
            events = [list(request) for request in requests]
            results[label] = (events, [r.prompt_logprobs for r in requests], engine.stats().batched_prompts)
    assert [results[label][2] for label in ("shared", "split", "alone")] == [3, 2, 0]
    assert [[e.token_id for e in got] for got in results["split"][0]] == [[e.token_id for e in got] for got in results["shared"][0]]
    events, prompt_logprobs, _ = results["shared"]
    for prompt, got, got_prompt in zip(prompts, events, prompt_logprobs, strict=True):
        tokens = [e.token_id for e in got]
        assert tokens == _alone(llama_export, prompt, 6)
        reference = _log_softmax(torch_llama, prompt + tokens[:-1])
        for step, event in enumerate(got):
            assert event.logprob is not None and abs(event.logprob.logprob - reference[len(prompt) - 1 + step][tokens[step]]) < 2e-4
        assert got_prompt[0] is None and len(got_prompt) == len(prompt)
        for position, logprob in enumerate(got_prompt[1:], start=1):
            assert logprob is not None and abs(logprob.logprob - reference[position - 1][prompt[position]]) < 2e-4
    # the shared call gives each row the numbers its own calls give
    unbatched_events, unbatched_prompt_logprobs, _ = results["alone"]
    assert [[e.token_id for e in got] for got in events] == [[e.token_id for e in got] for got in unbatched_events]
    for shared, split, own in zip(prompt_logprobs, results["split"][1], unbatched_prompt_logprobs, strict=True):
        np.testing.assert_allclose([p.logprob for p in shared[1:]], [p.logprob for p in own[1:]], atol=1e-5)
        np.testing.assert_allclose([p.logprob for p in split[1:]], [p.logprob for p in own[1:]], atol=1e-5)
