"""Speculative decoding: greedy output equal to plain greedy, sampling that keeps the target's distribution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from kvexport import verify
from kvexport.cli import main
from kvexport.errors import KvexportError
from kvexport.runtime import Generator, SamplingConfig
from kvexport.runtime.speculative import (
    DraftModel,
    PromptLookup,
    SpeculativeGenerator,
    verify_drafts,
)
from kvexport.serving import Engine, SamplingParams
from tests.conftest import TRAINED

HELDOUT_IDS = Tokenizer.from_file(str(TRAINED / "tokenizer.json")).encode((TRAINED / "heldout.txt").read_text()).ids
# a passage, then its start again: the continuation repeats what the prompt holds
EDIT_PROMPT = HELDOUT_IDS[:150] + HELDOUT_IDS[30:50]


def test_an_in_place_all_logits_export_verifies_and_decodes_through_its_prefill_graph(trained_all_logits: Path) -> None:
    report = verify(trained_all_logits, steps=3, record=False)
    assert report.ok, report.failures()
    assert {check.case for check in report.tokens} == {"batch1", "batch2-left-padded", "slots-ragged"}


@pytest.mark.parametrize("drafter", ["lookup", "draft-model"])
def test_greedy_speculation_gives_plain_greedy_tokens(
    trained_all_logits: Path, trained_exports: dict[str, Path], drafter: str
) -> None:
    want = Generator(trained_all_logits).generate([EDIT_PROMPT], 60, eos_token_id=-1)[0, len(EDIT_PROMPT) :].tolist()
    chosen = PromptLookup() if drafter == "lookup" else DraftModel(trained_exports["int8"])
    speculative = SpeculativeGenerator(trained_all_logits, chosen, draft_tokens=4)
    assert speculative.generate(EDIT_PROMPT, 60, eos_token_id=-1) == want
    stats = speculative.last_stats
    assert stats.new_tokens == 60 and sum(stats.round_tokens) == 59  # the first token comes from the prompt
    assert stats.rounds < 59 and 0 < stats.accepted <= stats.proposed  # drafts were kept: fewer calls than tokens
    assert stats.rounds == len(stats.round_tokens) and sum(stats.round_tokens) == stats.rounds + stats.accepted


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


@pytest.mark.parametrize("drafter", ["point-mass", "distribution"])
def test_the_accept_resample_rule_keeps_the_target_distribution(drafter: str) -> None:
    """The token after the pending one follows the target's p, whatever the drafts were drawn from."""
    rng = np.random.default_rng(0)
    target_logits = np.array([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.3, 0.1, 0.2, -0.5]], dtype=np.float32)
    p = _softmax(target_logits[0].astype(np.float64))
    q = _softmax(np.array([0.0, 2.0, 0.0, 1.0, -1.0]))  # a draft that disagrees with the target
    sampling = SamplingConfig(do_sample=True)
    counts = np.zeros(5)
    trials = 40_000
    for _ in range(trials):
        if drafter == "point-mass":  # a lookup draft: always token 1
            drafts, draft_probs = [1], None
        else:
            drafts, draft_probs = [int(rng.choice(5, p=q))], q[None]
        kept, token = verify_drafts(target_logits, drafts, draft_probs, sampling, rng)
        counts[drafts[0] if kept else token] += 1  # the token emitted after the pending one
    assert np.abs(counts / trials - p).max() < 0.01  # binomial sd at most 0.0025


def test_sampled_speculation_is_reproducible_from_the_seed(trained_all_logits: Path) -> None:
    speculative = SpeculativeGenerator(trained_all_logits, PromptLookup())
    sampling = SamplingConfig(do_sample=True, temperature=0.8, top_k=40, seed=5)
    first = speculative.generate(EDIT_PROMPT, 30, sampling, eos_token_id=-1)
    assert speculative.generate(EDIT_PROMPT, 30, sampling, eos_token_id=-1) == first
    assert len(first) == 30 and all(0 <= t < 2048 for t in first)


def test_the_engine_speculates_for_a_request_running_alone(trained_all_logits: Path) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = Generator(trained_all_logits).generate([EDIT_PROMPT], 40, eos_token_id=-1)[0, len(EDIT_PROMPT) :].tolist()
    with Engine(trained_all_logits, slots=2, max_context=256, drafter=PromptLookup()) as engine:
        alone = engine.submit(EDIT_PROMPT, greedy).result()[0]
        stats = engine.stats()
        assert alone == want
        assert 0 < stats.accepted_tokens <= stats.drafted_tokens and stats.steps < 39
        # two at once decode together (no speculation) and still give each one's tokens
        other = HELDOUT_IDS[300:340]
        handles = [engine.submit(EDIT_PROMPT, greedy), engine.submit(other, greedy)]
        got = [h.result()[0] for h in handles]
    other_want = Generator(trained_all_logits).generate([other], 40, eos_token_id=-1)[0, len(other) :].tolist()
    assert got == [want, other_want]


def test_speculation_needs_an_all_logits_export(trained_exports: dict[str, Path]) -> None:
    message = (
        f"{trained_exports['none']}: its prefill graph returns the last position's logits only; speculative decoding "
        "needs them at every position: export with --all-logits"
    )
    with pytest.raises(KvexportError) as error:
        SpeculativeGenerator(trained_exports["none"])
    assert str(error.value) == message
    result = CliRunner().invoke(main, ["generate", str(trained_exports["none"]), "--prompt", "The", "--prompt-lookup"])
    assert result.exit_code == 2 and result.stderr.strip() == f"Error: {message}"


def test_generate_on_the_command_line_speculates(trained_all_logits: Path, trained_exports: dict[str, Path]) -> None:
    prompt = "The help topic for the for statement. The help topic for"
    plain = CliRunner().invoke(main, ["generate", str(trained_all_logits), "--prompt", prompt, "--max-new-tokens", "24"])
    for extra in (["--prompt-lookup"], ["--draft", str(trained_exports["int8"]), "--draft-tokens", "3"]):
        result = CliRunner().invoke(
            main, ["generate", str(trained_all_logits), "--prompt", prompt, "--max-new-tokens", "24", *extra]
        )
        assert result.exit_code == 0, result.output
        assert result.stdout == plain.stdout  # greedy: the same text
        assert "verify calls; drafts accepted" in result.stderr
    both = CliRunner().invoke(
        main, ["generate", str(trained_all_logits), "--prompt", prompt, "--prompt-lookup", "--draft", str(trained_exports["int8"])]
    )
    assert both.exit_code == 2 and both.stderr.strip() == "Error: --prompt-lookup and --draft: pick one drafter"


def test_speculation_ends_on_any_of_the_exports_eos_tokens(trained_all_logits: Path, tmp_path: Path) -> None:
    """As the Generator and the engine do: an export listing several EOS tokens (Llama 3) stops at any of them."""
    free = SpeculativeGenerator(trained_all_logits, PromptLookup()).generate(EDIT_PROMPT, 30, eos_token_id=-1)
    stop = next(i for i in range(3, 30) if free[i] not in free[:i])  # a token new at its place: made an EOS, it ends there
    export = shutil.copytree(trained_all_logits, tmp_path / "export")
    manifest = json.loads((export / "kvexport.json").read_text())
    unused = next(t for t in range(2048) if t not in free)
    manifest["tokenizer"]["eos_token_id"] = unused
    manifest["tokenizer"]["eos_token_ids"] = [unused, free[stop]]
    (export / "kvexport.json").write_text(json.dumps(manifest))
    speculative = SpeculativeGenerator(export, PromptLookup())
    assert speculative.generate(EDIT_PROMPT, 30) == free[: stop + 1]
    assert speculative.last_stats.rounds > 0  # it did speculate on the way
