"""Host-side bookkeeping of the runner's caches: KV pages and recurrent-state slots.

The tensors live in the model runner; these classes only hand out indices.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class BlockManager:
    """KV-cache pages of ``block_size`` tokens, placed so that a sequence's pages tend to be consecutive.

    Any page set is correct; consecutive pages are faster on CPU, where a decode then reads its keys and
    values as one view of the cache instead of copying them page by page. So a sequence grows into the
    page after its last one when that is free, and a new sequence starts in the largest free gap, in its
    middle (the sequence before the gap can grow into the first half, the new one into the second),
    or at the pool's start. When no gap is long enough the pages come from several gaps."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._is_free = np.ones(num_blocks, bool)
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def blocks_needed(self, num_blocks_held: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_blocks_held)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` pages for a sequence whose last page is ``after`` (None: a new sequence)."""
        if n > self._num_free:
            raise RuntimeError(f"KV cache exhausted: need {n} blocks, {self._num_free} free")
        if n == 0:
            return []
        if after is not None and after + 1 + n <= self.num_blocks and self._is_free[after + 1:after + 1 + n].all():
            blocks = np.arange(after + 1, after + 1 + n)
        else:
            starts, lengths = self._free_runs()
            best = int(np.argmax(lengths))
            if lengths[best] >= n:
                start, length = int(starts[best]), int(lengths[best])
                offset = 0 if after is not None or start == 0 else (length - n) // 2
                blocks = np.arange(start + offset, start + offset + n)
            else:  # fragmented pool: longest gaps first
                order = np.argsort(-lengths, kind="stable")
                blocks = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in order])[:n]
        self._is_free[blocks] = False
        self._num_free -= n
        return blocks.tolist()

    def free(self, blocks: list[int]) -> None:
        self._is_free[blocks] = True
        self._num_free += len(blocks)

    def _free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Start and length of every maximal run of free pages."""
        edges = np.diff(np.concatenate([[0], self._is_free.view(np.int8), [0]]))
        starts = np.flatnonzero(edges == 1)
        return starts, np.flatnonzero(edges == -1) - starts


class StateSlotAllocator:
    """Recurrent-state slots, one per live sequence for its whole lifetime."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free recurrent-state slot")
        return self._free.popleft()

    def free(self, slot: int) -> None:
        self._free.append(slot)
