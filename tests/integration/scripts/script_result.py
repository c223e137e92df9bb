"""How the torchrun scripts here start and end: one process group for every layout a launch
runs (`each_layout`), rank 0 writes each layout's DIR/result.json (`finish`)."""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

NEXT = "+"
"""Separates one layout's arguments from the next one's on a script's command line."""


def each_layout(main: Callable[[list[str]], None]) -> None:
    """`script.py ARGS [+ ARGS ...]`: main(ARGS) for each layout in turn, in this process, on one
    gloo group (megatron's model-parallel groups are torn down after each, by `finish`). A rank
    starts torch, megatron-core and megatron-bridge once for all of them: ~7.5 CPU-s a rank a
    launch on the 2-core test machine, most of a tiny layout's run (docs/development.md)."""
    argv = sys.argv[1:]
    layouts: list[list[str]] = [[]]
    for arg in argv:
        if arg == NEXT:
            layouts.append([])
        else:
            layouts[-1].append(arg)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        for layout in layouts:
            main(layout)
    finally:
        dist.destroy_process_group()


def finish(out: Path, result: dict) -> None:
    """Rank 0 writes `out`/result.json; every rank waits for it, then tears down megatron's
    model-parallel groups (if any were formed), which the next layout forms anew."""
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
