"""How the torchrun scripts here end: rank 0 writes DIR/result.json, then every rank leaves."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist


def finish(out: Path, result: dict) -> None:
    """Rank 0 writes `out`/result.json; every rank waits for it, then tears down megatron's
    model-parallel groups (if any were formed) and the default group."""
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()
