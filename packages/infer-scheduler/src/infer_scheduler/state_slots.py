"""The state slots of a hybrid model's linear-attention layers: one per running sequence, fixed in size.

A slot is a sequence's whole history in those layers (a conv window and a recurrent state per layer), so unlike
KV blocks it is neither paged nor shared: a request takes one at admission and gives it back on finish, abort
and preemption, next to its blocks (`KvCacheManager`). Slots are numbered `1..num_slots`; the worker keeps slot 0
as scratch for padding rows. Freeing a slot twice, or one never taken, raises `SlotError` at once.
"""

from __future__ import annotations


class SlotError(RuntimeError):
    """A double free, a free of a slot never taken, or a take from an empty pool."""


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots, 0, -1))  # LIFO: slot 1 goes first on a fresh pool
        self._taken: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise SlotError(f"all {self.num_slots} state slots are taken")
        slot = self._free.pop()
        self._taken.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._taken:
            raise SlotError(f"free of state slot {slot}, which is not taken")
        self._taken.remove(slot)
        self._free.append(slot)

    def check(self, held: list[int]) -> None:
        """The holders' slots are exactly the taken ones, each held once; the free list is the rest."""
        if len(set(held)) != len(held):
            raise SlotError(f"a state slot is held twice: {sorted(held)}")
        if set(held) != self._taken:
            raise SlotError(f"held slots {sorted(held)} != taken slots {sorted(self._taken)}")
        if len(set(self._free)) != len(self._free) or set(self._free) | self._taken != set(range(1, self.num_slots + 1)):
            raise SlotError("free list and taken slots disagree")
