"""Speculative decoding of one sequence: draft tokens cheaply, verify them in one call.

A decode step reads every weight to make one token. Verifying ``k`` drafted tokens costs
one call of the prefill graph with a past (batch 1, the pending token and the ``k``
drafts as ``k + 1`` new tokens), which reads the weights once too; every draft the
target agrees with is a token won. In the in-place cache a rejected draft's rows need no
undoing: the sequence's length goes back and the next call overwrites them.

Drafters:

- :class:`PromptLookup`: the tokens that followed the latest earlier occurrence of the
  sequence's last n-gram (Hugging Face's ``prompt_lookup_num_tokens``); no second model.
  Pays where the output repeats its context: editing or continuing a given passage.
- :class:`DraftModel`: a smaller in-place export with the same tokenizer, which drafts
  by decoding ``k`` tokens itself (Hugging Face's ``assistant_model``).

Acceptance follows the standard rule (Leviathan et al. 2023; Chen et al. 2023): greedy
keeps a draft while it is the target's argmax, so the output equals plain greedy
decoding; sampling keeps draft ``x`` with probability ``min(1, p(x) / q(x))`` and on a
rejection samples from ``max(0, p - q)`` renormalized, so every token follows the
target's own distribution ``p`` (temperature, top-k and top-p applied). A lookup draft is
a point mass (``q(x) = 1``).

The target must be an in-place export whose prefill graph returns logits at every
position (``--all-logits``): verification needs the target's distribution after each
draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer

from kvexport.bundle.manifest import Manifest
from kvexport.drafting import DEFAULT_DRAFT_TOKENS, DraftBudget, common_prefix
from kvexport.errors import KvexportError
from kvexport.runtime.cache import SlotCache
from kvexport.runtime.generator import GenerationStats
from kvexport.runtime.opened import OpenedExport, check_prompt, open_export
from kvexport.runtime.sampling import SamplingConfig, draw, token_probabilities
from kvexport.runtime.session import open_session, session_options
from kvexport.runtime.text import text_pieces


class Drafter(Protocol):
    """Proposes up to ``count`` tokens to follow ``tokens``."""

    def propose(
        self, tokens: Sequence[int], count: int, sampling: SamplingConfig, rng: np.random.Generator
    ) -> tuple[list[int], np.ndarray | None]:
        """The drafts and, per draft, the distribution it was drawn from ([n, V]; None: point masses)."""


class PromptLookup:
    """Drafts by n-gram lookup in the sequence so far (prompt and output).

    The last ``n`` tokens (``max_ngram`` down to ``min_ngram``) are searched for earlier
    in the sequence, latest occurrence first; the tokens after the match are the drafts.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise KvexportError(f"n-gram sizes {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(
        self, tokens: Sequence[int], count: int, sampling: SamplingConfig, rng: np.random.Generator
    ) -> tuple[list[int], np.ndarray | None]:
        """The tokens after the latest earlier match of the sequence's tail (none if no match)."""
        sequence = np.asarray(tokens)
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)
            hits = np.flatnonzero((windows == sequence[-n:]).all(-1))
            if hits.size:
                start = int(hits[-1]) + n
                return sequence[start : start + count].tolist(), None
        return [], None


class _Row:
    """One sequence in one row of an in-place cache, run a piece at a time at batch 1."""

    def __init__(
        self,
        opened: OpenedExport,
        capacity: int | None,
        *,
        spinning: bool,
        intra_op_threads: int | None,
    ) -> None:
        opened.require_in_place("speculative decoding rolls rejected drafts back in the in-place cache")
        self.manifest: Manifest = opened.manifest
        self.provider = opened.provider
        self.capacity = min(capacity or self.manifest.dims.max_positions, self.manifest.dims.max_positions)
        options = session_options(intra_op_threads, spinning=spinning)
        self.session = open_session(opened.directory / self.manifest.graphs["prefill"].file, self.provider, options)
        self.cache = SlotCache(self.manifest, self.provider, 1, self.capacity)
        self.tokens: list[int] = []  # what the cache rows hold

    def run(self, piece: Sequence[int]) -> np.ndarray:
        """Feed ``piece`` after the cached tokens; the logits after each (all-logits graph) or the last: [n, V]."""
        if len(self.tokens) + len(piece) > self.capacity:
            raise KvexportError(f"{len(self.tokens) + len(piece)} tokens: more than the {self.capacity} this sequence has room for")
        logits = self.cache.run_piece(self.session, 0, piece, len(self.tokens))
        self.tokens.extend(piece)
        return logits

    def keep(self, count: int) -> None:
        """Forget every cached token after the first ``count`` (their rows are overwritten later)."""
        del self.tokens[count:]


class DraftModel:
    """Drafts with a smaller in-place export sharing the target's tokenizer.

    Its cache follows the target's sequence: before drafting it keeps the tokens both
    agree on, feeds the rest in one call, then decodes ``count`` tokens one at a time.
    """

    def __init__(
        self,
        directory: str | Path,
        provider: str = "cpu",
        *,
        capacity: int | None = None,
        spinning: bool = False,
        intra_op_threads: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self._row = _Row(open_export(self.directory, provider), capacity, spinning=spinning, intra_op_threads=intra_op_threads)
        self.manifest = self._row.manifest

    def propose(
        self, tokens: Sequence[int], count: int, sampling: SamplingConfig, rng: np.random.Generator
    ) -> tuple[list[int], np.ndarray | None]:
        """``count`` tokens drawn from the draft model (greedy when ``sampling`` is), with their distributions."""
        row = self._row
        count = min(count, row.capacity - len(tokens))
        if count <= 0:
            return [], None
        row.keep(common_prefix(row.tokens, tokens))
        if len(row.tokens) == len(tokens):  # nothing new to feed: the last token's logits are needed again
            row.keep(len(tokens) - 1)
        logits = row.run(tokens[len(row.tokens) :])[-1:]
        drafts, probabilities = [], []
        for index in range(count):
            probs = token_probabilities(logits, sampling)
            token = int(draw(probs, rng)[0]) if sampling.do_sample else int(logits[0].argmax())
            drafts.append(token)
            probabilities.append(probs[0])
            if index < count - 1:
                logits = row.run([token])[-1:]
        return drafts, np.stack(probabilities)


@dataclass
class SpeculativeStats(GenerationStats):
    """One speculative generation: :class:`GenerationStats` plus rounds (target calls) and drafts."""

    batch: int = 1
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    round_tokens: list[int] = field(default_factory=list)  # tokens emitted by each round

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed ones (0 when none were proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0


def require_all_logits(directory: Path, manifest: Manifest) -> None:
    """Refuse, in one line, a target whose prefill graph returns only the last position's logits."""
    if not manifest.all_logits:
        raise KvexportError(
            f"{directory}: its prefill graph returns the last position's logits only; speculative decoding "
            "needs them at every position: export with --all-logits"
        )


def verify_drafts(
    logits: np.ndarray,
    drafts: Sequence[int],
    draft_probs: np.ndarray | None,
    sampling: SamplingConfig,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """How many drafts the target keeps, and the token after them.

    ``logits`` [len(drafts) + 1, V] are the target's after the pending token and after
    each draft. Greedy keeps a draft while it is the argmax; sampling applies the
    accept / resample rule (see the module docstring).
    """
    if not sampling.do_sample:
        argmax = logits.argmax(-1)
        kept = 0
        while kept < len(drafts) and argmax[kept] == drafts[kept]:
            kept += 1
        return kept, int(argmax[kept])
    target = token_probabilities(logits, sampling)
    for index, token in enumerate(drafts):
        drafted = 1.0 if draft_probs is None else float(draft_probs[index, token])
        if rng.random() * drafted < target[index, token]:  # accept with min(1, p / q)
            continue
        residual = target[index].copy()
        if draft_probs is None:
            residual[token] = 0.0
        else:
            residual = np.maximum(residual - draft_probs[index], 0.0)
        if residual.sum() <= 0:  # p == q up to rounding: any draw from p is right
            residual = target[index]
        return index, int(draw(residual[None], rng)[0])
    return len(drafts), int(draw(target[-1:], rng)[0])


def speculative_round(
    drafter: Drafter,
    budget: DraftBudget,
    context: Sequence[int],
    room: int,
    run: Callable[[Sequence[int]], np.ndarray],
    sampling: SamplingConfig,
    rng: np.random.Generator,
) -> tuple[list[int], int, int]:
    """One round: draft after ``context`` (which ends with the pending token), verify in one call.

    ``room`` caps the drafts (tokens left to generate, rows left in the cache); ``run``
    feeds a piece after the cached rows and returns the target's logits after each token.
    Returns the drafts, how many the target kept, and the token after them; the caller
    rolls its cache back past the rejected drafts.
    """
    count = min(budget.next_count(), room)
    drafts, draft_probs = drafter.propose(context, count, sampling, rng) if count > 0 else ([], None)
    logits = run([context[-1], *drafts])
    kept, following = verify_drafts(logits, drafts, draft_probs, sampling, rng)
    budget.update(len(drafts), kept)
    return drafts, kept, following


class SpeculativeGenerator:
    """Generate one sequence at a time with speculative decoding (see the module docstring).

    Args:
        directory: an in-place export with ``--all-logits`` (the target).
        drafter: :class:`PromptLookup` (the default) or :class:`DraftModel`.
        draft_tokens: drafts per round.
        provider: ``cpu``, ``cuda`` or ``auto``.
        spinning: let the target's threads spin between a run's nodes (off by default beside
            a draft model, whose own session would compete with them).
        intra_op_threads: ONNX Runtime threads (default: ONNX Runtime's choice).

    """

    def __init__(
        self,
        directory: str | Path,
        drafter: Drafter | None = None,
        *,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
        provider: str = "cpu",
        spinning: bool | None = None,
        intra_op_threads: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        if draft_tokens < 1:
            raise KvexportError(f"draft tokens {draft_tokens}: must be at least 1")
        opened = open_export(self.directory, provider)
        self.manifest = opened.manifest
        require_all_logits(self.directory, self.manifest)
        self.drafter: Drafter = drafter or PromptLookup()
        if isinstance(self.drafter, DraftModel) and self.drafter.manifest.dims.vocab_size != self.manifest.dims.vocab_size:
            raise KvexportError(
                f"--draft {self.drafter.directory}: its vocabulary has {self.drafter.manifest.dims.vocab_size} tokens, "
                f"the target's {self.manifest.dims.vocab_size}; the draft must share the target's tokenizer"
            )
        self.draft_tokens = draft_tokens
        self.spinning = not isinstance(self.drafter, DraftModel) if spinning is None else spinning
        self.eos_token_id: int | None = opened.eos_token_id
        self.eos_token_ids: tuple[int, ...] = opened.eos_token_ids  # every token that ends it (Llama 3 has several)
        self._tokenizer = opened.tokenizer
        self.tokenizer: Tokenizer | None = self._tokenizer.tokenizer
        self._row = _Row(opened, None, spinning=self.spinning, intra_op_threads=intra_op_threads)
        self.provider = self._row.provider
        self.last_stats = SpeculativeStats()

    def stream(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 20,
        sampling: SamplingConfig | None = None,
        eos_token_id: int | None = None,
    ) -> Iterator[int]:
        """Yield the new tokens of one prompt as they are decided; ``last_stats`` is set when it ends."""
        sampling = sampling or SamplingConfig()
        if sampling.do_sample:
            sampling.validate()
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise KvexportError(f"max_new_tokens {max_new_tokens!r}: must be a positive integer")
        tokens = [int(t) for t in prompt]
        limit = self.manifest.dims.max_positions
        check_prompt(tokens, self.manifest.dims.vocab_size, max_new_tokens, limit)
        stops = self.eos_token_ids if eos_token_id is None else (eos_token_id,)
        rng = np.random.default_rng(sampling.seed)
        row, stats = self._row, SpeculativeStats()
        self.last_stats = stats
        row.keep(0)
        started = time.perf_counter()
        pending = int(_choose(row.run(tokens)[-1:], sampling, rng))
        stats.ttft_s = time.perf_counter() - started
        emitted, produced = [pending], 0
        budget = DraftBudget(self.draft_tokens)
        while True:
            yield from emitted
            produced += len(emitted)
            stats.new_tokens = produced
            if emitted[-1] in stops or produced >= max_new_tokens:
                return
            started = time.perf_counter()
            tokens.append(pending)
            room = min(max_new_tokens - produced - 1, limit - len(tokens))
            drafts, kept, pending = speculative_round(self.drafter, budget, tokens, room, row.run, sampling, rng)
            row.keep(len(tokens) + kept)
            tokens.extend(drafts[:kept])
            emitted = _until_eos([*drafts[:kept], pending], stops)
            stats.rounds += 1
            stats.proposed += len(drafts)
            stats.accepted += kept
            stats.round_tokens.append(len(emitted))
            stats.decode_s += time.perf_counter() - started

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 20,
        sampling: SamplingConfig | None = None,
        eos_token_id: int | None = None,
    ) -> list[int]:
        """The new tokens of one prompt, all at once."""
        return list(self.stream(prompt, max_new_tokens, sampling, eos_token_id))

    def stream_text(
        self, prompt: str, max_new_tokens: int = 20, sampling: SamplingConfig | None = None
    ) -> Iterator[str]:
        """Yield decoded text pieces of one text prompt as tokens are decided; stops at EOS."""
        tokenizer = self._tokenizer.require()
        if not prompt:
            raise KvexportError("the prompt is empty; pass some text")
        tokens = self.stream(self.encode(prompt), max_new_tokens, sampling)
        yield from text_pieces(tokenizer, tokens, self.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the export's tokenizer."""
        return self._tokenizer.encode(text)


def _choose(logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator) -> int:
    if not sampling.do_sample:
        return int(logits[-1].argmax())
    return int(draw(token_probabilities(logits[-1:], sampling), rng)[0])


def _until_eos(tokens: list[int], stops: Sequence[int]) -> list[int]:
    """``tokens`` up to and including the first that ends the generation (any of ``stops``)."""
    ended = next((i for i, token in enumerate(tokens) if token in stops), None)
    return tokens if ended is None else tokens[: ended + 1]

