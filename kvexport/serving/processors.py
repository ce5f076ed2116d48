"""Logits processors and the next-token choice of one request, in vLLM v1's order.

On a float32 copy of the row: ``allowed_token_ids``, then ``min_tokens`` (the stop tokens
banned until then), then ``logit_bias``, then the repetition, frequency and presence
penalties (vLLM's ``apply_penalties``). Then greedy takes the argmax; sampling divides by
the temperature, applies ``min_p``, then top-k and top-p, and draws.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvexport.runtime.sampling import (
    SamplingConfig,
    choose_tokens,
    draw,
    softmax,
    token_probabilities,
)
from kvexport.serving.request import Logprob, SamplingParams

BANNED_BIAS = -100.0  # a logit_bias of -100 bans its token (OpenAI: "should result in a ban")


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


def controlled_scores(raw: np.ndarray, params: SamplingParams, prompt: Sequence[int], output: Sequence[int], stop_ids: Sequence[int]) -> np.ndarray:
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


def choose(scores: np.ndarray, params: SamplingParams, sampling: SamplingConfig, rng: np.random.Generator) -> int:
    """The next token from a processed row: argmax (greedy), or a draw after temperature, min-p, top-k, top-p."""
    if not sampling.do_sample or params.min_p == 0:
        return int(choose_tokens(scores[None], sampling, rng)[0])
    return int(draw(distribution(scores, params, sampling)[None], rng)[0])


def distribution(scores: np.ndarray, params: SamplingParams, sampling: SamplingConfig) -> np.ndarray:
    """What a sampled token is drawn from (float64 [V]).

    Temperature, then ``min_p`` (tokens below ``min_p`` times the likeliest's probability
    are dropped), then top-k and top-p.
    """
    scaled = scores.astype(np.float64) / sampling.temperature
    if params.min_p:
        probs = softmax(scaled)
        scaled = np.where(probs < params.min_p * probs.max(), -np.inf, scaled)
    return token_probabilities(scaled[None], dataclasses.replace(sampling, temperature=1.0))[0]


def logprob_of(logprobs: np.ndarray, token: int, top: int, ids: tuple[int, ...] | None = None) -> Logprob:
    """The :class:`Logprob` of ``token`` in one row of log-probabilities, with the ``top`` likeliest tokens, or ``ids``' in their order."""
    if top < 0:  # -1: every token
        top = logprobs.shape[-1]
    if ids:
        alternatives = tuple((int(t), float(logprobs[t])) for t in ids)
    elif top:
        best = np.argpartition(-logprobs, top - 1)[:top]
        best = best[np.argsort(-logprobs[best], kind="stable")]
        alternatives = tuple((int(t), float(logprobs[t])) for t in best)
    else:
        alternatives = ()
    rank = int((logprobs > logprobs[token]).sum()) + 1
    return Logprob(int(token), float(logprobs[token]), rank, alternatives)

