"""The plain-Python parts of speculative decoding, shared by the runtime and the serving scheduler.

How many tokens to draft next (:class:`DraftBudget`) and how many leading tokens two
sequences share (:func:`common_prefix`, also the prefix cache's match). Nothing here loads
ONNX Runtime, onnx or torch, so :mod:`kvexport.serving.scheduler` can import it without a
model, and :mod:`kvexport.runtime.speculative` without importing the serving package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_DRAFT_TOKENS = 4


@dataclass
class DraftBudget:
    """How many tokens to draft next: more while drafts are all kept, fewer after a rejection.

    Hugging Face's schedule for assistant models (+2 after a step that kept every draft,
    -1 after one that did not, at most ``limit``), except that it may fall to 0: drafts
    that keep failing then stop, and one draft is tried again every ``probe_every`` steps.
    A verify call of two tokens costs more than a plain step (1.10x measured on GPT-2
    124M), so a drafter that never pays costs next to nothing this way.
    """

    limit: int
    current: int = -1
    probe_every: int = 8
    _idle: int = 0

    def __post_init__(self) -> None:
        if self.current < 0:
            self.current = self.limit

    def next_count(self) -> int:
        """How many drafts to ask for this step (0: a plain step)."""
        if self.current:
            return self.current
        self._idle += 1
        if self._idle < self.probe_every:
            return 0
        self._idle = 0
        return 1

    def update(self, proposed: int, kept: int) -> None:
        """Adjust after a step that proposed ``proposed`` drafts and kept ``kept``."""
        if proposed:
            self.current = min(self.limit, self.current + 2) if kept == proposed else max(0, self.current - 1)


def common_prefix(cached: Sequence[int], tokens: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens ``cached`` and ``tokens`` share (at most ``limit``)."""
    length = min(len(cached), len(tokens), len(tokens) if limit is None else limit)
    if length <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(cached[:length]) != np.asarray(tokens[:length]))
    return int(differ[0]) if differ.size else length
