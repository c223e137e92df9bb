"""The trainer's process group: how every rank joins it, and the one flag rank 0 tells all."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from relax_slurm.config import TrainConfig


def init_distributed(cfg: TrainConfig) -> torch.device:
    # every collective waits at most this long: ranks 1.. wait in scatter while rank 0 waits
    # for the broker, so the bound must cover a batch fetch
    timeout = datetime.timedelta(seconds=cfg.trainer.get_batch_timeout_s + 300)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout)
        return torch.device("cuda", local)
    torch.set_num_threads(cfg.trainer.torch_threads)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def broadcast_flag(flag: bool) -> bool:
    """Rank 0's `flag` on every rank (a preemption request only rank 0 reads)."""
    t = torch.tensor([int(flag)])
    dist.broadcast(t, src=0)
    return bool(t.item())
