"""The cache's bookkeeping: what each slot's rows hold, prefix matching, pinning and LRU order.

Plain Python: it never touches the buffers. A slot's rows stay valid after its request
ends, so the table keeps, per slot, the tokens they hold. A new prompt that starts with
tokens cached in some slot reuses those rows (:meth:`SlotTable.place`): in place when the
slot holding them is free and as cheap a place as any, else copied into the slot it gets
(where the runner can copy rows: CPU). Slots are handed out so the decode rows stay few:
a free slot below the highest running one, least recently used first, else the lowest
free one. A pinned slot (a registered prefix) is never handed to a request.

Over the paged cache (``blocks``, a :class:`~kvexport.serving.blocks.BlockManager`) a slot is
only a row of the block table: placing a request gives its slot blocks for its prompt (a
reused prefix's blocks shared, not copied), a free slot's cached blocks go back to the pool
least recently used first when blocks run short (:meth:`SlotTable.reclaim`), and a request's
rows that may be half written give theirs back at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvexport.drafting import common_prefix
from kvexport.serving.blocks import BlockManager

# A cached prefix shorter than this is not worth copying from another slot
MIN_COPIED_PREFIX = 16


@dataclass
class Resident:
    """What one slot's rows hold: the tokens of its first rows, valid after its request ends."""

    tokens: list[int] = field(default_factory=list)
    used: float = 0.0  # when they were last written or reused
    pinned: bool = False  # a registered prefix: never handed to a request


@dataclass(frozen=True)
class Placement:
    """Where a request goes: its slot, how many prompt tokens are cached there, and the copy that puts them there."""

    slot: int
    reused: int
    copy_from: int | None = None  # copy the first ``reused`` rows of this slot into ``slot`` first
    block_copies: tuple[tuple[int, int], ...] = ()  # paged: copy these (from, to) blocks first instead


class SlotTable:
    """Per slot, the tokens its rows hold (see the module docstring)."""

    def __init__(
        self,
        slots: int,
        *,
        prefix_cache: bool = True,
        can_copy_rows: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        blocks: BlockManager | None = None,
    ) -> None:
        self.residents = [Resident() for _ in range(slots)]
        self.prefix_cache = prefix_cache
        self.can_copy_rows = can_copy_rows or blocks is not None  # paged: a prefix is shared, never copied row by row
        self.clock = clock
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.residents)

    def free(self, busy: Collection[int]) -> list[int]:
        """Slots neither held by a request (``busy``) nor pinned, lowest first."""
        return [slot for slot, r in enumerate(self.residents) if slot not in busy and not r.pinned]

    @property
    def pinned(self) -> int:
        """Slots kept for registered prefixes."""
        return sum(r.pinned for r in self.residents)

    def place(self, prompt: Sequence[int], free: Sequence[int], rows: int, *, reuse: bool = True) -> Placement:
        """The slot for ``prompt`` among ``free`` while slots ``0..rows-1`` decode, and the prefix it reuses.

        At least the prompt's last token is left to prefill: its logits give the first token.
        The table records the placement (the slot then holds the reused tokens).
        """
        below = [slot for slot in free if slot < rows]
        target = min(below, key=lambda slot: self.residents[slot].used) if below else min(free)
        placement = Placement(target, 0)
        if self.prefix_cache and reuse:
            placement = self._best_reuse(prompt, free, rows, target)
        resident = self.residents[placement.slot]
        if placement.copy_from is not None:
            self.residents[placement.copy_from].used = self.clock()
        resident.tokens = list(prompt[: placement.reused])
        resident.used = self.clock()
        if self.blocks is not None:  # room checked by the scheduler (BlockManager.needed_to_admit)
            copies = self.blocks.assign(placement.slot, placement.reused, len(prompt) + 1, source=placement.copy_from)
            placement = Placement(placement.slot, placement.reused, placement.copy_from, tuple(copies))
        return placement

    def _best_reuse(self, prompt: Sequence[int], free: Sequence[int], rows: int, target: int) -> Placement:
        limit = len(prompt) - 1
        matches = [(common_prefix(r.tokens, prompt, limit), slot) for slot, r in enumerate(self.residents)]
        best, source = max(matches, key=lambda match: (match[0], match[1] in free))
        own = matches[target][0]
        if best > own and source in free and (source < rows or source <= target):
            return Placement(source, best)  # in place, and no more decode rows than the target
        if best > own and best >= MIN_COPIED_PREFIX and self.can_copy_rows:
            return Placement(target, best, copy_from=source)
        return Placement(target, own)

    def pin_slot(self, free: Sequence[int]) -> int:
        """Pin the slot for a registered prefix: the highest free one, out of the way of the decode rows."""
        slot = max(free)
        self.residents[slot].tokens = []
        self.residents[slot].pinned = True
        return slot

    def unpin_slot(self, slot: int) -> None:
        """``slot`` holds no registered prefix any more."""
        self.residents[slot].pinned = False

    def length(self, slot: int) -> int:
        """How many of ``slot``'s first rows are valid."""
        return len(self.residents[slot].tokens)

    def wrote(self, slot: int, start: int, tokens: Sequence[int]) -> None:
        """Rows ``start..`` of ``slot`` now hold ``tokens`` (what was after them is gone)."""
        resident = self.residents[slot]
        del resident.tokens[start:]
        resident.tokens.extend(tokens)

    def keep(self, slot: int, length: int) -> None:
        """Only the first ``length`` rows of ``slot`` stay valid."""
        del self.residents[slot].tokens[length:]

    def release(self, slot: int, *, valid: bool = True) -> None:
        """A request left ``slot``; its rows stay cached unless they may be half written (``valid`` False)."""
        resident = self.residents[slot]
        resident.used = self.clock()
        if not valid:
            resident.tokens.clear()
        if self.blocks is not None and (not valid or not self.prefix_cache):
            self._drop_blocks(slot)

    def reclaim(self, busy: Collection[int], needed: int) -> bool:
        """Paged: free slots give their cached blocks back, least recently used first, until ``needed`` are free; whether they are."""
        blocks = self.blocks
        if blocks is None:
            return True
        idle = sorted((r.used, slot) for slot, r in enumerate(self.residents) if slot not in busy and not r.pinned and blocks.owned[slot])
        for _, slot in idle:
            if blocks.free >= needed:
                break
            self._drop_blocks(slot)
        return blocks.free >= needed

    def _drop_blocks(self, slot: int) -> None:
        """Paged: ``slot``'s blocks go back to the pool, and with them the tokens its rows held."""
        assert self.blocks is not None
        self.blocks.release(slot)
        self.residents[slot].tokens.clear()

    def unpin(self, tokens: Sequence[int]) -> bool:
        """Free the pinned slot holding exactly ``tokens``; False if none does."""
        for resident in self.residents:
            if resident.pinned and resident.tokens == list(tokens):
                resident.pinned = False
                return True
        return False

    def forget(self) -> None:
        """Nothing is cached any more (after a warm-up)."""
        for slot, resident in enumerate(self.residents):
            resident.tokens.clear()
            resident.pinned = False
            if self.blocks is not None:
                self._drop_blocks(slot)
