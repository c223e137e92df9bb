"""The threads a blocking environment's plain reset/step/close run in (`env.threads`), and how
busy they are. An environment whose step takes seconds (a sandbox, a request) holds one thread
per episode in it; with every thread busy the next calls wait for one, and the episodes then
wait on the pool, not on the environment. The worker's heartbeat carries `load()`, and a
stalled run's note says when the pool is full (launch/waiting.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class EnvThreads:
    """`await threads.run(fn, *args)`: `fn(*args)` in one of `n` threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="env")
        self._lock = threading.Lock()
        self._submitted = 0  # calls handed to the pool and not finished
        self._running = 0  # of those, calls a thread runs now

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            self._submitted += 1
        try:
            future = self._pool.submit(self._counted, fn, *args)
        except BaseException:
            with self._lock:
                self._submitted -= 1
            raise
        future.add_done_callback(self._if_dropped)
        # counted by the thread itself, so a call whose episode was cancelled is counted
        # until it really ends: its thread stays taken that long
        return await asyncio.wrap_future(future)

    def _if_dropped(self, future) -> None:
        if future.cancelled():  # cancelled before a thread took it: it never ran
            with self._lock:
                self._submitted -= 1

    def _counted(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running -= 1
                self._submitted -= 1

    def load(self) -> dict[str, int]:
        """{threads, busy: calls running, waiting: calls queued for a free thread}."""
        with self._lock:
            return {"threads": self.n, "busy": self._running,
                    "waiting": self._submitted - self._running}

    def close(self) -> None:
        """Queued calls are dropped; running ones finish in their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
