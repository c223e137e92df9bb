"""No request to an engine whose weights the broker would drop.

An engine restarted in place (or one that missed a sync) serves its initial weights, version 0,
until the trainer re-forms the weight-sync cohort and pushes the current ones. Until then every
sample it makes is dropped by the broker as stale: on the tiny task a restarted engine made
~13,000 of them in the ~30 s before its re-sync, each one generation, scoring and broker
traffic for nothing, while the healthy engines got fewer requests.

The broker tells the worker its floor (the oldest version it still accepts: trainer version -
max_staleness) with every credit grant and every accepted group. An engine whose results come
back older than that floor is *behind*: the router sends it nothing more (the requests in
flight finish) until its /model_info says it serves at least the floor again; it is asked at
most every `RECHECK_S`. With every engine behind, a pick waits for the first to catch up
rather than generating samples that would be dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from relax_slurm.engines.client import GenerateResult
from relax_slurm.errors import EngineError

log = logging.getLogger(__name__)
RECHECK_S = 0.5
PROBE_TIMEOUT_S = 5.0  # a behind engine that does not answer /model_info this fast stays behind


def oldest_version(results: Iterable[GenerateResult]) -> int | None:
    """The oldest policy version among the results' tokens (None: none reported)."""
    versions = [v for r in results for v in r.versions()]
    return min(versions) if versions else None


class VersionGate:
    def __init__(self, floor: Callable[[], int | None],
                 served_version: Callable[[str], Awaitable[str | None]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`floor()`: the broker's floor as last told (None: not yet); `served_version(url)`:
        the weight version an engine serves now (/model_info)."""
        self.floor_of = floor
        self.served_version = served_version
        self.clock = clock
        self.behind: dict[str, int] = {}  # url -> the floor it must reach
        self._checked = float("-inf")
        self._background: asyncio.Task | None = None
        self.gated = 0
        """Engines found behind so far (a metric: restarts, missed syncs)."""

    def check(self, url: str, results: list[GenerateResult]) -> None:
        """After an engine's answer: behind if its tokens are older than the floor."""
        floor, oldest = self.floor_of(), oldest_version(results)
        if floor is None or oldest is None or oldest >= floor or url in self.behind:
            return
        self.behind[url] = floor
        self.gated += 1
        log.warning("engine %s served version %d, older than the broker accepts (%d): no new "
                    "requests to it until it serves the current weights (restarted? the "
                    "trainer re-syncs it)", url, oldest, floor)

    def allows(self, url: str) -> bool:
        return url not in self.behind

    async def refresh(self) -> None:
        """Ask the behind engines (at most every RECHECK_S) which version they serve; readmit
        those at their floor or newer. An engine that does not answer stays behind."""
        if not self.behind or self.clock() - self._checked < RECHECK_S:
            return
        self._checked = self.clock()
        for url, floor in list(self.behind.items()):
            try:
                served = await self.served_version(url)
            except EngineError:
                continue
            if served is not None and int(served) >= floor:
                del self.behind[url]
                log.info("engine %s serves version %s again: routed to", url, served)

    def poke(self) -> None:
        """Refresh in the background (a pick that has allowed engines does not wait on a behind
        one's answer)."""
        if self.behind and (self._background is None or self._background.done()):
            self._background = asyncio.ensure_future(self.refresh())

    async def wait_for_one(self, urls: list[str]) -> None:
        """Until one of `urls` is allowed (every candidate engine is behind)."""
        while not any(self.allows(u) for u in urls):
            await self.refresh()
            await asyncio.sleep(RECHECK_S / 5)
