"""Next-token choice from logits: greedy, or sampling with temperature / top-k / top-p."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvexport.errors import KvexportError


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
