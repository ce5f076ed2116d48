"""The paged cache's bookkeeping: which blocks of the pool each slot's positions live in.

Plain Python over one int32 array, the block table the runner binds by address
(:class:`~kvexport.runtime.cache.PagedCache`): slot s's position t is in block
``table[s, t // PAGE_TOKENS]``. A block may back several slots (a shared prompt prefix: a
count of holders per block); a slot only ever writes blocks it alone holds, because
:meth:`BlockManager.assign` gives a request fresh blocks from where it starts writing, and
copies (rather than shares) a partly valid block it would write into. Block 0 is never handed
out: a table entry no block backs points at it, so a row that writes one harmless position
past its own (a free slot in a decode call) writes there.
"""

from __future__ import annotations

import numpy as np

from kvexport.passes.vocabulary import PAGE_TOKENS

SPARE_BLOCK = 0  # the block unbacked table entries name (never handed out)


def blocks_for(positions: int) -> int:
    """Blocks that hold ``positions`` positions."""
    return -(-positions // PAGE_TOKENS)


class BlockManager:
    """Hands out the pool's blocks to slots and takes them back (see the module docstring).

    ``table``: the runner's block table ([slots, blocks a slot may hold]), written in place.
    """

    def __init__(self, blocks: int, table: np.ndarray) -> None:
        self.table = table
        self.blocks = blocks
        self.width = table.shape[1]
        self.holders = [0] * blocks
        self.holders[SPARE_BLOCK] = 1
        self._free = list(range(blocks - 1, 0, -1))  # popped from the end: low blocks first
        self.owned: list[list[int]] = [[] for _ in range(table.shape[0])]

    @property
    def free(self) -> int:
        """Blocks no slot holds."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Blocks some slot holds (the spare block not counted)."""
        return self.blocks - 1 - len(self._free)

    def positions(self, slot: int) -> int:
        """Positions ``slot``'s blocks back."""
        return len(self.owned[slot]) * PAGE_TOKENS

    def needed(self, slot: int, end: int) -> int:
        """Fresh blocks ``slot`` needs so that positions ``0..end-1`` are backed."""
        return max(0, min(blocks_for(end), self.width) - len(self.owned[slot]))

    def grow(self, slot: int, end: int) -> None:
        """Back ``slot``'s positions ``0..end-1`` (at most its table's width) with fresh blocks where they are not yet."""
        owned = self.owned[slot]
        while len(owned) < min(blocks_for(end), self.width):
            block = self._take()
            self.table[slot, len(owned)] = block
            owned.append(block)

    def release(self, slot: int) -> None:
        """``slot`` holds no blocks any more (each goes back to the pool once no slot holds it)."""
        for block in self.owned[slot]:
            self._drop(block)
        self.owned[slot] = []
        self.table[slot] = SPARE_BLOCK

    def assign(self, slot: int, reused: int, end: int, *, source: int | None = None) -> list[tuple[int, int]]:
        """Give ``slot`` the first ``reused`` positions of ``source`` (None: its own) and fresh blocks up to ``end``; the block copies to make first.

        The request writes from position ``reused - 1`` on (a prompt's last token after a
        cached prefix runs with the one before it, which it writes again), so the blocks wholly
        below that are kept or shared, the block that holds it is kept where ``slot`` alone holds
        it and copied into a fresh one otherwise, and the rest are fresh. Returns (from, to)
        block pairs to copy before the next call. The caller has checked that enough blocks are
        free (:meth:`needed_to_admit`).
        """
        kept = max(0, reused - 1) // PAGE_TOKENS
        partial = reused > kept * PAGE_TOKENS  # the block holding position reused - 1 has valid positions
        origin = self.owned[slot if source is None else source]
        shared = origin[: kept + (1 if partial else 0)]
        for block in shared:
            self.holders[block] += 1  # held while the slot's own are let go (source may be slot)
        self.release(slot)
        copies = []
        owned = self.owned[slot] = shared[:kept]
        if partial:
            block = shared[kept]
            if self.holders[block] > 1:  # someone else holds it too: write a copy
                self._drop(block)
                fresh = self._take()
                copies.append((block, fresh))
                block = fresh
            owned.append(block)
        self.table[slot, : len(owned)] = owned
        self.grow(slot, end)
        return copies

    def needed_to_admit(self, end: int) -> int:
        """The most fresh blocks :meth:`assign` may take for a request that ends its prompt's call at ``end``."""
        return min(blocks_for(end), self.width) + 1

    def _take(self) -> int:
        if not self._free:
            raise RuntimeError("the paged cache's pool has no free block (the scheduler checks before it asks)")
        block = self._free.pop()
        self.holders[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.holders[block] -= 1
        if self.holders[block] == 0:
            self._free.append(block)
