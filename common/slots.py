"""Which sequence owns which KV slot and how far it has got. Plain Python: no torch, no gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from common.errors import CapacityExhausted, InvalidRequest, UnknownSequence

S = TypeVar("S")


@dataclass
class SlotTable(Generic[S]):
    """Maps sequence ids to slots [0, num_slots) and per-sequence state of type S."""

    num_slots: int
    _free: list[int] = field(default_factory=list)
    _owned: dict[str, tuple[int, S]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {self.num_slots}")
        self._free = list(range(self.num_slots - 1, -1, -1))

    def acquire(self, seq_id: str, state: S) -> int:
        if not seq_id:
            raise InvalidRequest("sequence id must not be empty")
        if seq_id in self._owned:
            raise InvalidRequest(f"sequence {seq_id!r} already exists")
        if not self._free:
            raise CapacityExhausted(f"all {self.num_slots} sequence slots are in use")
        slot = self._free.pop()
        self._owned[seq_id] = (slot, state)
        return slot

    def get(self, seq_id: str) -> tuple[int, S]:
        try:
            return self._owned[seq_id]
        except KeyError:
            raise UnknownSequence(f"unknown sequence id {seq_id!r}") from None

    def release(self, seq_id: str) -> bool:
        entry = self._owned.pop(seq_id, None)
        if entry is None:
            return False
        self._free.append(entry[0])
        return True

    def __len__(self) -> int:
        return len(self._owned)


def check_unique(seq_ids: list[str]) -> None:
    """A batch names each sequence once."""
    seen: set[str] = set()
    for s in seq_ids:
        if s in seen:
            raise InvalidRequest(f"sequence {s!r} appears twice in one batch")
        seen.add(s)
