"""Pick an engine for the next request: the one with the fewest requests in flight."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Generic, TypeVar

E = TypeVar("E")


class LeastLoadedRouter(Generic[E]):
    def __init__(self, engines: list[E]) -> None:
        if not engines:
            raise ValueError("no engines to route to")
        self.engines = engines
        self.inflight = [0] * len(engines)

    @contextlib.asynccontextmanager
    async def pick(self) -> AsyncIterator[E]:
        i = min(range(len(self.engines)), key=self.inflight.__getitem__)
        self.inflight[i] += 1
        try:
            yield self.engines[i]
        finally:
            self.inflight[i] -= 1
