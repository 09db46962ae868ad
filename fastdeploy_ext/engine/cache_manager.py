"""Host-side bookkeeping of the runner's caches: KV pages and recurrent-state slots.

The tensors live in the model runner; these classes only hand out indices.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Free list of KV-cache pages of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_blocks_held: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_blocks_held)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache exhausted: need {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


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
