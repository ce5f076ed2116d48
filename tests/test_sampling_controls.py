"""The engine's sampling controls and log-probabilities, each against an independent reference.

- logits processors against their published formulas written here, or transformers'
  logits processors where one exists;
- log-probabilities against the log-softmax of PyTorch's logits on the same tokens;
- greedy decoding under a control against a reference loop over PyTorch's logits;
- sampled output against the Generator run alone with the same settings.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from kvexport.runtime import Generator
from kvexport.runtime.sampling import SamplingConfig, add_logit_bias, apply_penalties, distribution
from kvexport.serving import Engine, SamplingParams
from tests.conftest import TRAINED

HELDOUT_IDS = Tokenizer.from_file(str(TRAINED / "tokenizer.json")).encode((TRAINED / "heldout.txt").read_text()).ids
PROMPT = HELDOUT_IDS[40:70]


@pytest.fixture(scope="module")
def torch_model() -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(TRAINED).eval()


def _torch_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """PyTorch's logits after every position of ``ids``: [len, V] float64."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(logits), -1).numpy()


def _events(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    return list(engine.submit(prompt, params))


# ---------------------------------------------------------------- processors against formulas


def test_penalties_follow_openais_and_hugging_faces_formulas() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    scores = rng.normal(size=50).astype(np.float32)
    prompt, output = [1, 2, 3, 3], [3, 4, 4, 4, 9]
    got = apply_penalties(scores.copy(), prompt, output, frequency=0.5, presence=1.25)
    want = scores.copy()
    for token in set(output):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        want[token] -= output.count(token) * 0.5 + 1.25
    np.testing.assert_allclose(got, want, rtol=1e-6)
    repeated = apply_penalties(scores.copy(), prompt, output, repetition=1.7)
    reference = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), torch.from_numpy(scores.copy())[None])
    np.testing.assert_allclose(repeated, reference[0].numpy(), rtol=1e-6)


def test_logit_bias_adds_and_minus_100_bans() -> None:
    scores = np.zeros(8, np.float32)
    biased = add_logit_bias(scores, {2: 3.5, 5: -100.0, 6: -99.0})
    assert biased[2] == 3.5 and biased[5] == -np.inf and biased[6] == -99.0 and biased[0] == 0.0


def test_min_p_keeps_what_transformers_min_p_warper_keeps() -> None:
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    rng = np.random.default_rng(1)
    scores = rng.normal(scale=3.0, size=300).astype(np.float32)
    params = SamplingParams(temperature=0.7, min_p=0.05)
    got = distribution(scores, params, params.sampling())
    row = torch.from_numpy(scores.astype(np.float64))[None]
    warped = MinPLogitsWarper(0.05)(None, TemperatureLogitsWarper(0.7)(None, row))
    want = torch.softmax(warped, -1)[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-9)
    assert 0 < (got > 0).sum() < 300


# ---------------------------------------------------------------- the engine against PyTorch


@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_logprobs_are_the_log_softmax_of_pytorchs_logits(trained_exports: dict[str, Path], torch_model: torch.nn.Module, scheme: str) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    with Engine(trained_exports[scheme], slots=2, max_context=64) as engine:
        events = _events(engine, PROMPT, params)
    tokens = [e.token_id for e in events]
    reference = _log_softmax(_torch_logits(torch_model, PROMPT + tokens[:-1]))[len(PROMPT) - 1 :]
    tolerance = 2e-4 if scheme == "none" else 0.15  # int8 blocks: within the scheme's quality
    for step, event in enumerate(events):
        assert event.logprob is not None and event.logprob.token_id == tokens[step]
        assert abs(event.logprob.logprob - reference[step, tokens[step]]) < tolerance
        top_ids = [t for t, _ in event.logprob.top]
        assert len(top_ids) == 5 and top_ids[0] == tokens[step]  # greedy: the chosen token is the likeliest
        np.testing.assert_allclose([v for _, v in event.logprob.top], reference[step, top_ids], atol=tolerance)
        if scheme == "none":
            assert top_ids == np.argsort(-reference[step])[:5].tolist()
            assert event.logprob.rank == 1


def test_prompt_logprobs_span_chunks_and_equal_pytorchs(trained_all_logits: Path, torch_model: torch.nn.Module) -> None:
    prompt = HELDOUT_IDS[100:140]
    with Engine(trained_all_logits, slots=2, max_context=64, chunk=16) as engine:  # three prefill chunks
        request = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
        request.result()
    reference = _log_softmax(_torch_logits(torch_model, prompt))
    assert request.prompt_logprobs[0] is None and len(request.prompt_logprobs) == len(prompt)
    for position, logprob in enumerate(request.prompt_logprobs[1:], start=1):
        assert logprob is not None and logprob.token_id == prompt[position]
        assert abs(logprob.logprob - reference[position - 1, prompt[position]]) < 2e-4
        assert [t for t, _ in logprob.top] == np.argsort(-reference[position - 1])[:3].tolist()
        assert logprob.rank == int((reference[position - 1] > reference[position - 1, prompt[position]]).sum()) + 1


def test_prompt_logprobs_need_an_all_logits_export(trained_exports: dict[str, Path]) -> None:
    with Engine(trained_exports["none"], slots=1, max_context=64) as engine, pytest.raises(Exception) as caught:
        engine.submit(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert str(caught.value) == (
        "prompt logprobs need the logits at every prompt position, and none's prefill graph returns the last "
        "position's only; serve an export made with --all-logits"
    )


def _reference_greedy(model: torch.nn.Module, prompt: list[int], steps: int, control: object) -> list[int]:
    """Greedy decoding over PyTorch's logits with ``control(scores, output)`` applied at each step."""
    output: list[int] = []
    for _ in range(steps):
        scores = _torch_logits(model, prompt + output)[-1].astype(np.float32)
        output.append(int(np.argmax(control(scores, output))))  # type: ignore[operator]
    return output


def _presence_frequency(scores: np.ndarray, output: list[int]) -> np.ndarray:
    for token in set(output):
        scores[token] -= 1.5 * 1.0 + 0.7 * output.count(token)
    return scores


def _repetition(scores: np.ndarray, output: list[int]) -> np.ndarray:
    for token in set(PROMPT) | set(output):
        scores[token] = scores[token] / 1.8 if scores[token] > 0 else scores[token] * 1.8
    return scores


def _bias(scores: np.ndarray, output: list[int]) -> np.ndarray:
    scores[17] += 12.0
    scores[42] += 6.0
    return scores


@pytest.mark.parametrize(
    ("params", "control"),
    [
        (SamplingParams(presence_penalty=1.5, frequency_penalty=0.7), _presence_frequency),
        (SamplingParams(repetition_penalty=1.8), _repetition),
        (SamplingParams(logit_bias={17: 12.0, 42: 6.0}), _bias),
    ],
    ids=["presence-frequency", "repetition", "logit-bias"],
)
def test_greedy_under_a_control_equals_a_reference_loop_over_pytorch(
    trained_exports: dict[str, Path], torch_model: torch.nn.Module, params: SamplingParams, control: object
) -> None:
    import dataclasses

    settings = dataclasses.replace(params, max_tokens=16, temperature=0, ignore_eos=True)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with Engine(trained_exports["none"], slots=2, max_context=64) as engine:
        got = engine.submit(PROMPT, settings).result()[0]
        without = engine.submit(PROMPT, plain).result()[0]
    assert got == _reference_greedy(torch_model, PROMPT, 16, control)
    assert got != without  # the control changed the text


def test_banned_tokens_and_allowed_tokens_are_never_chosen(trained_exports: dict[str, Path]) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(trained_exports["none"], slots=2, max_context=64) as engine:
        greedy = engine.submit(PROMPT, plain).result()[0]
        banned = set(greedy)
        without = engine.submit(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias=dict.fromkeys(banned, -100.0))).result()[0]
        allowed = (5, 6, 7)
        only = engine.submit(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=1, allowed_token_ids=allowed)).result()[0]
    assert not banned & set(without)
    assert set(only) <= set(allowed)


def test_stop_token_ids_min_tokens_and_including_the_stop_string(trained_exports: dict[str, Path]) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(trained_exports["none"], slots=2, max_context=64) as engine:
        greedy, text, _ = engine.submit(PROMPT, plain).result()
        stop_id = greedy[3]
        first = greedy.index(stop_id)
        request = engine.submit(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)))
        tokens, stopped_text, reason = request.result()
        assert (tokens, reason, request.stop_reason) == (greedy[: first + 1], "stop", stop_id)
        assert engine.tokenizer is not None
        assert stopped_text == engine.tokenizer.decode(greedy[:first])  # the stop token's text is left out
        # min_tokens: the stop token is banned until then, so the text runs past it
        late = engine.submit(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,), min_tokens=first + 2))
        late_tokens = late.result()[0]
        assert len(late_tokens) >= first + 2 and stop_id not in late_tokens[: first + 2]
        stop = text[5:9]
        kept = engine.submit(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True))
        assert kept.result()[1] == text[: text.index(stop) + len(stop)] and kept.stop_reason == stop


def test_sampled_output_equals_the_generator_alone_with_the_same_settings(trained_exports: dict[str, Path]) -> None:
    export = trained_exports["none"]
    settings = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 11}
    want = Generator(export).generate([PROMPT], 20, do_sample=True, eos_token_id=-1, **settings)[0, len(PROMPT) :].tolist()
    top_k_only = Generator(export).generate([PROMPT], 20, do_sample=True, eos_token_id=-1, temperature=1.0, top_k=3, seed=11)[0, len(PROMPT) :].tolist()
    with Engine(export, slots=4, max_context=64) as engine:
        others = [engine.submit(HELDOUT_IDS[i : i + 9], SamplingParams(max_tokens=20, temperature=1.0, seed=i)) for i in (0, 300)]
        got = engine.submit(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, **settings)).result()[0]
        got_top_k = engine.submit(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, top_k=3, seed=11)).result()[0]
        for other in others:
            other.result()
    assert got == want and got_top_k == top_k_only and got != got_top_k


def test_n_samples_with_a_seed_equal_the_same_seeds_one_by_one(trained_exports: dict[str, Path]) -> None:
    prompt = HELDOUT_IDS[500:530]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=21, ignore_eos=True)
    with Engine(trained_exports["none"], slots=4, max_context=64) as engine:
        together = engine.submit_n(prompt, params, 3)
        got = [r.result()[0] for r in together]
        alone = [engine.submit(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=21 + i, ignore_eos=True)).result()[0] for i in range(3)]
    assert got == alone and len({tuple(t) for t in got}) == 3
    assert [r.cached_tokens for r in together] == [0, len(prompt) - 1, len(prompt) - 1]  # prefilled once, rows copied


def test_sixteen_requests_with_logprobs_get_what_each_gets_alone(trained_exports: dict[str, Path]) -> None:
    prompts = [HELDOUT_IDS[37 * i : 37 * i + 3 + 5 * i] for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    with Engine(trained_exports["none"], slots=16, max_context=100, chunk=48) as engine:
        together = [engine.submit(p, params) for p in prompts]
        batched = [list(r) for r in together]
        alone = [_events(engine, p, params) for p in prompts]
    for got, want in zip(batched, alone, strict=True):
        assert [e.token_id for e in got] == [e.token_id for e in want]
        for a, b in zip(got, want, strict=True):
            assert a.logprob is not None and b.logprob is not None
            assert abs(a.logprob.logprob - b.logprob.logprob) < 1e-5
            assert [t for t, _ in a.logprob.top] == [t for t, _ in b.logprob.top]


def test_sampling_config_validation_is_shared(trained_exports: dict[str, Path]) -> None:
    with pytest.raises(Exception, match=r"^top_k -1: must be >= 0 \(0 disables it\)$"):
        SamplingParams(top_k=-1).validate()
    with pytest.raises(Exception, match=r"^top_k -1: must be >= 0 \(0 disables it\)$"):
        SamplingConfig(do_sample=True, top_k=-1).validate()
    with pytest.raises(Exception, match=r"^presence_penalty 2.5: must be in \[-2, 2\]$"):
        SamplingParams(presence_penalty=2.5).validate()
    with pytest.raises(Exception, match=r"^logit_bias: token ids 5000, -1 are out of vocabulary \(its 2048 tokens are 0..2047\)$"):
        SamplingParams(logit_bias={5000: 1.0, 7: 1.0, -1: 2.0}).validate(2048)  # every bad key named, as vLLM


def test_the_warm_up_leaves_no_trace(trained_exports: dict[str, Path]) -> None:
    with Engine(trained_exports["none"], slots=2, max_context=64) as engine:  # two warm-up requests by default
        stats = engine.stats()
        assert (stats.steps, stats.prompt_tokens, stats.generated_tokens, stats.finished) == (0, 0, 0, {})
        assert not any(resident.tokens for resident in engine.table.residents)


def test_an_unknown_engine_setting_is_one_line(trained_exports: dict[str, Path]) -> None:
    with pytest.raises(Exception, match=r"^unknown engine setting 'slot'; the settings are slots, max_context, "):
        Engine(trained_exports["none"], slot=2)
