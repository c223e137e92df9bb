"""An overlapped weight push: version v+1 goes to the engines while the trainer moves on.

Async runs (`algo.max_staleness >= 1`, `weight_sync.overlap`): after step v, rank 0 hands the
push of version v+1 (send, verify, then the broker's `set_version`, in that order: the version
protocol is unchanged) to one background thread, and the loop goes on to the checkpoint, the
next step's `get_batch`, collation and, streaming, its forward/backward. Only the optimizer
must wait: the tensors being sent are the model's own (DDP), so `before_update` joins the push
before the weights change. The thread has its own broker socket (zmq sockets are not
thread-safe); the engines are the thread's alone until the join.

What is exposed is the time the loop waited at that join: `perf/weight_sync_s`; the push's own
duration is `perf/weight_sync_push_s` (the same in a run without overlap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


def _on_side_stream(fn: Callable[[], Any]) -> Callable[[], Any]:
    """GPUs: the push's NCCL kernels on their own stream, after the work that made the weights,
    so that they run beside the next step's kernels instead of queueing behind them."""
    if not torch.cuda.is_available():
        return fn
    made = torch.cuda.current_stream()

    def run() -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(made)
        with torch.cuda.stream(side):
            out = fn()
        side.synchronize()
        return out
    return run


class BackgroundPush:
    """At most one push in flight; `join` waits for it and re-raises what it raised."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-push")
        self.future: Future | None = None
        self.started = 0.0
        self.took = 0.0

    @property
    def busy(self) -> bool:
        return self.future is not None

    @property
    def engines_free(self) -> bool:
        """No push holds the engines: none started, or the one started ended well (it may wait
        to be joined for the whole of the next batch's wait; a failed one is left for `join`
        to raise)."""
        f = self.future
        return f is None or (f.done() and not f.cancelled() and f.exception() is None)

    def start(self, push: Callable[[], Any]) -> None:
        assert self.future is None, "one push at a time: join the previous one first"
        self.started = time.monotonic()

        def timed() -> Any:
            try:
                return push()
            finally:
                self.took = time.monotonic() - self.started
        self.future = self.pool.submit(_on_side_stream(timed))

    def join(self) -> tuple[Any, float]:
        """(the push's result, seconds this call waited)."""
        assert self.future is not None
        t = time.monotonic()
        try:
            return self.future.result(), time.monotonic() - t
        finally:
            self.future = None

    def close(self) -> None:
        self.pool.shutdown(wait=True)
