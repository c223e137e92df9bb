"""When a role's next heartbeat is due.

Roles heartbeat from their main loop (the trainer's step and batch-wait loop, the rollout
worker's dispatch loop), never from a thread of their own: a thread keeps beating while the
loop is stuck, so it would prove the process exists, not that it makes progress. The launcher
treats a role whose last beat is older than `cluster.restart.heartbeat_timeout_s` as hung
(relax_slurm/launch/health.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Pacer:
    """`due()` is True at the first call and then at most once per `interval_s`."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")

    def due(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True
