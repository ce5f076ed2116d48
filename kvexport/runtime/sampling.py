"""The sampler: logits processors and the next-token choice, for the Generator and the serving engine alike.

The Generator picks tokens with :class:`SamplingConfig` alone (:func:`choose_tokens`:
greedy, or temperature, top-k and top-p as Hugging Face ``generate`` applies them). A
served request adds vLLM v1's logits processors, in its order, on a float32 copy of its row
(:func:`controlled_scores`): ``allowed_token_ids``, then ``min_tokens`` (the stop tokens
banned until then), then ``logit_bias``, then the repetition, frequency and presence
penalties (vLLM's ``apply_penalties``); then greedy takes the argmax, and sampling divides
by the temperature, applies ``min_p``, then top-k and top-p, and draws (:func:`choose`).

The request's settings come in as any object with the fields of :class:`LogitsControls`
(the serving layer's ``SamplingParams``), so this module needs nothing above the runtime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvexport.errors import KvexportError

BANNED_BIAS = -100.0  # a logit_bias of -100 bans its token (OpenAI: "should result in a ban")


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token, with Hugging Face ``generate``'s meanings.

    ``do_sample=False`` is greedy (argmax) and ignores the rest. ``top_k=0`` and
    ``top_p=1.0`` disable those filters. ``seed`` makes sampling reproducible.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        """Raise a one-line error for an out-of-range option."""
        if self.temperature <= 0:
            raise KvexportError(
                f"temperature {self.temperature}: must be > 0 (use do_sample=False for greedy)"
            )
        if self.top_k < 0:
            raise KvexportError(f"top_k {self.top_k}: must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise KvexportError(f"top_p {self.top_p}: must be in (0, 1] (1 disables it)")


def choose_tokens(
    logits: np.ndarray, config: SamplingConfig, rng: np.random.Generator
) -> np.ndarray:
    """Pick one token per row from ``logits`` [batch, V]; returns int64 [batch]."""
    if not config.do_sample:
        return logits.argmax(-1).astype(np.int64)
    return draw(token_probabilities(logits, config), rng)


def token_probabilities(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """The distribution ``config`` samples from, per row of ``logits`` [batch, V] (float64).

    Greedy (``do_sample=False``) is all the mass on the argmax; otherwise temperature,
    then top-k, then top-p, as Hugging Face applies them.
    """
    if not config.do_sample:
        probs = np.zeros(logits.shape, dtype=np.float64)
        np.put_along_axis(probs, logits.argmax(-1)[:, None], 1.0, axis=-1)
        return probs
    scores = logits.astype(np.float64) / config.temperature
    vocab = scores.shape[-1]
    if 0 < config.top_k < vocab:
        kth = np.partition(scores, vocab - config.top_k, axis=-1)[:, vocab - config.top_k, None]
        scores = np.where(scores < kth, -np.inf, scores)
    if config.top_p < 1.0:
        order = np.argsort(-scores, axis=-1)
        sorted_scores = np.take_along_axis(scores, order, axis=-1)
        probs = softmax(sorted_scores)
        # drop a token when the tokens ranked above it already reach top_p (the first is always kept)
        drop_sorted = (np.cumsum(probs, axis=-1) - probs) >= config.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        scores = np.where(drop, -np.inf, scores)
    return softmax(scores)


def draw(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of ``probs`` [batch, V] (rows need not sum to 1); int64 [batch]."""
    cdf = np.cumsum(probs, axis=-1)
    draws = rng.random((probs.shape[0], 1)) * cdf[:, -1:]
    # the first token whose cdf exceeds the draw; a zero-probability token never does
    chosen = (cdf <= draws).sum(-1)
    return np.minimum(chosen, probs.shape[-1] - 1).astype(np.int64)


def softmax(scores: np.ndarray) -> np.ndarray:
    """Probabilities of each row of scores (the last axis), shifted by the row's maximum."""
    shifted = np.exp(scores - scores.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Log-probabilities of each row of logits (any float in, float64 out)."""
    scores = rows.astype(np.float64)
    top = scores.max(-1, keepdims=True)
    return scores - top - np.log(np.exp(scores - top).sum(-1, keepdims=True))


# ---------------------------------------------------------------- a served request's logits processors


class LogitsControls(Protocol):
    """The request settings the logits processors and :func:`choose` read (``SamplingParams`` has them all)."""

    @property
    def allowed_token_ids(self) -> Sequence[int] | None:
        """Only these tokens may be chosen (None: any)."""

    @property
    def min_tokens(self) -> int:
        """The stop tokens are banned until this many tokens are out."""

    @property
    def logit_bias(self) -> dict[int, float] | None:
        """Added to each listed token's logit; -100 bans it."""

    @property
    def repetition_penalty(self) -> float:
        """Hugging Face's and vLLM's (1: none)."""

    @property
    def frequency_penalty(self) -> float:
        """OpenAI's (0: none)."""

    @property
    def presence_penalty(self) -> float:
        """OpenAI's (0: none)."""

    @property
    def min_p(self) -> float:
        """Tokens below ``min_p`` times the likeliest's probability are dropped (0: none)."""


def allowed_only(scores: np.ndarray, allowed: Sequence[int]) -> np.ndarray:
    """Every token outside ``allowed`` gets -inf."""
    keep = np.full(scores.shape, -np.inf, dtype=scores.dtype)
    index = np.asarray(allowed, dtype=np.int64)
    keep[index] = scores[index]
    return keep


def ban(scores: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """``tokens`` get -inf (``min_tokens``: the stop tokens until then)."""
    scores[np.asarray(tokens, dtype=np.int64)] = -np.inf
    return scores


def add_logit_bias(scores: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    """Add each token's bias to its logit; a bias of -100 bans the token."""
    for token, value in bias.items():
        scores[token] = -np.inf if value <= BANNED_BIAS else scores[token] + value
    return scores


def apply_penalties(
    scores: np.ndarray,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    repetition: float = 1.0,
    frequency: float = 0.0,
    presence: float = 0.0,
) -> np.ndarray:
    """The penalties as vLLM applies them: repetition over prompt and output tokens, frequency and presence over the output.

    Repetition (Hugging Face's and vLLM's): a seen token's logit is divided by the penalty
    when positive and multiplied by it otherwise. Frequency and presence (OpenAI's):
    ``logit - frequency * count - presence * (count > 0)``, counts over the output.
    """
    vocab = scores.shape[-1]
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)[:vocab]
    if repetition != 1.0:
        seen = counts > 0
        seen[np.asarray(prompt, dtype=np.int64)] = True
        scores = np.where(seen, np.where(scores > 0, scores / repetition, scores * repetition), scores).astype(scores.dtype)
    if frequency:
        scores -= frequency * counts
    if presence:
        scores -= presence * (counts > 0)
    return scores


def controlled_scores(
    raw: np.ndarray, params: LogitsControls, prompt: Sequence[int], output: Sequence[int], stop_ids: Sequence[int]
) -> np.ndarray:
    """The row after every logits processor the request asks for (``raw`` is not changed)."""
    scores = raw.astype(np.float32, copy=True)
    if params.allowed_token_ids is not None:
        scores = allowed_only(scores, params.allowed_token_ids)
    if len(output) < params.min_tokens and stop_ids:
        scores = ban(scores, stop_ids)
    if params.logit_bias:
        scores = add_logit_bias(scores, params.logit_bias)
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        scores = apply_penalties(
            scores,
            prompt,
            output,
            repetition=params.repetition_penalty,
            frequency=params.frequency_penalty,
            presence=params.presence_penalty,
        )
    return scores


def choose(scores: np.ndarray, params: LogitsControls, sampling: SamplingConfig, rng: np.random.Generator) -> int:
    """The next token from a processed row: argmax (greedy), or a draw after temperature, min-p, top-k, top-p."""
    if not sampling.do_sample or params.min_p == 0:
        return int(choose_tokens(scores[None], sampling, rng)[0])
    return int(draw(distribution(scores, params, sampling)[None], rng)[0])


def distribution(scores: np.ndarray, params: LogitsControls, sampling: SamplingConfig) -> np.ndarray:
    """What a sampled token is drawn from (float64 [V]).

    Temperature, then ``min_p`` (tokens below ``min_p`` times the likeliest's probability
    are dropped), then top-k and top-p.
    """
    scaled = scores.astype(np.float64) / sampling.temperature
    if params.min_p:
        probs = softmax(scaled)
        scaled = np.where(probs < params.min_p * probs.max(), -np.inf, scaled)
    return token_probabilities(scaled[None], dataclasses.replace(sampling, temperature=1.0))[0]
