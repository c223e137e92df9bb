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

Where the export is gathered through every rank (FSDP2, megatron) the push cannot read it as
the ranks gather it, since the next step needs the ranks: rank 0 keeps a whole copy of the
served weights in host memory while it sends. `overlap_copy_fits` checks that copy against the
memory the host has at start, and a copy that would not fit falls back to the inline,
streamed push, said once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

HOST_SHARE = 0.5
"""The share of the host memory available at start that an overlapped push's whole copy may
take (the rest: the trainer's own host memory, the data, a checkpoint being written)."""


def copy_fits(copy_bytes: int, available_bytes: int | None) -> bool:
    """Whether a whole copy of `copy_bytes` fits beside the trainer (None: unknown: yes)."""
    return available_bytes is None or copy_bytes <= HOST_SHARE * available_bytes


def host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def served_bytes(model_path: str, dtype: torch.dtype) -> int:
    """The bytes of model.path's weights at the dtype the engines serve: from the safetensors
    headers, or from .bin files mapped, not read (`checkpoint/hf_files.py weight_shapes`)."""
    from relax_slurm.checkpoint.hf_files import weight_shapes

    numel = sum(math.prod(shape) for shape in weight_shapes(Path(model_path)).values())
    return numel * torch.empty((), dtype=dtype).element_size()


def overlap_copy_fits(cfg, available: Callable[[], int | None] = host_memory_available
                      ) -> bool:
    """Whether an overlapped push may keep its whole copy (module docstring): always under DDP
    (it sends the model's own tensors) and for an adapter-only sync; else when the served
    weights fit in HOST_SHARE of the host's `available()` memory. A copy that does not fit is
    said once, with the fix."""
    from relax_slurm.trainer.model import DTYPES

    t = cfg.trainer
    gathered = t.backend == "megatron" or t.strategy == "fsdp2"
    if not gathered or cfg.adapter_sync:
        return True
    need = served_bytes(cfg.model.path, DTYPES[cfg.model.dtype])
    have = available()
    if copy_fits(need, have):
        return True
    log.warning("weight_sync.overlap: an overlapped push keeps a whole copy of the served "
                "weights (%.1f GiB) in rank 0's host memory, more than %d%% of the %.1f GiB "
                "available: pushing inline, streamed, instead (no rank holds the whole model). "
                "Set weight_sync.overlap=false to say so, or give the trainer's node more memory",
                need / 2**30, int(HOST_SHARE * 100), have / 2**30)
    return False


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
