"""Requests the broker cannot answer yet (`acquire` with no credit, `get_batch` with too few
groups), parked first in, first out with a deadline; the loop answers them when a later request
changes the state, or at the deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class Parked:
    identity: bytes
    rid: Any
    args: dict[str, Any]
    start: float
    deadline: float


class ParkedQueue:
    """One kind of parked request, oldest first."""

    def __init__(self) -> None:
        self._items: list[Parked] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Parked]:
        return iter(list(self._items))

    def park(self, identity: bytes, rid: Any, args: dict[str, Any], wait_s: float) -> None:
        now = time.monotonic()
        self._items.append(Parked(identity, rid, args, now, now + wait_s))

    def holds(self, identity: bytes, rid: Any) -> bool:
        """Whether this request is parked (a resend of it waits with it)."""
        return any(p.identity == identity and p.rid == rid for p in self._items)

    def first(self) -> Parked | None:
        return self._items[0] if self._items else None

    def pop_first(self) -> Parked:
        return self._items.pop(0)

    def expired(self, now: float) -> list[Parked]:
        """Take out the requests whose deadline has passed, oldest first."""
        due = [p for p in self._items if p.deadline <= now]
        self._items = [p for p in self._items if p.deadline > now]
        return due

    def take_all(self) -> list[Parked]:
        out, self._items = self._items, []
        return out

    def deadlines(self) -> list[float]:
        return [p.deadline for p in self._items]
