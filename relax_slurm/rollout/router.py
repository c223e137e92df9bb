"""Pick an engine for the next request: the routable one with the fewest requests in flight.

The engine set can change while the worker runs (elastic rollout, broker/elastic.py): `add`
puts a new engine in, `route_only` keeps the next picks to some engines (a draining one gets no
new request but its requests in flight finish), `idle_unroutable` lists those with none left.
An engine behind the broker's version floor gets nothing either until it catches up
(version_gate.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import AsyncIterator, Generic, TypeVar

from relax_slurm.errors import EngineError
from relax_slurm.rollout.version_gate import VersionGate

E = TypeVar("E")


class LeastLoadedRouter(Generic[E]):
    def __init__(self, engines: list[E], gate: VersionGate | None = None) -> None:
        """`gate`: engines serving weights the broker would drop get nothing (version_gate.py;
        the engines then have a `url`)."""
        if not engines:
            raise ValueError("no engines to route to")
        self.gate = gate
        self.engines = list(engines)
        self.inflight = [0] * len(engines)
        self.routable = [True] * len(engines)
        self.picked = [0] * len(engines)
        """Requests sent to each engine so far."""

    def add(self, engine: E) -> None:
        self.engines.append(engine)
        self.inflight.append(0)
        self.routable.append(True)
        self.picked.append(0)

    def route_only(self, keep: Callable[[E], bool]) -> None:
        self.routable = [keep(e) for e in self.engines]

    def idle_unroutable(self) -> list[E]:
        return [e for e, ok, n in zip(self.engines, self.routable, self.inflight)
                if not ok and n == 0]

    @contextlib.asynccontextmanager
    async def pick(self) -> AsyncIterator[E]:
        candidates = [i for i in range(len(self.engines)) if self.routable[i]]
        if not candidates:
            raise EngineError("no routable engine (every engine is draining); scale out or "
                              "wait for the scale-in to end")
        if self.gate is not None:
            self.gate.poke()
            await self.gate.wait_for_one([self.engines[i].url for i in candidates])
            candidates = [i for i in candidates if self.gate.allows(self.engines[i].url)]
        i = min(candidates, key=self.inflight.__getitem__)
        self.inflight[i] += 1
        self.picked[i] += 1
        try:
            yield self.engines[i]
        finally:
            self.inflight[i] -= 1
