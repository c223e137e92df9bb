"""The trainer's process group: how every rank joins it, and the control request (preempt,
stop; runtime/control.py) rank 0 reads and tells all."""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from relax_slurm.config import TrainConfig
from relax_slurm.runtime.control import PREEMPT_EXIT_CODE, REQUESTS, STOP
from relax_slurm.trainer import collectives

log = logging.getLogger("relax_slurm.trainer")


def collective_timeout_s(cfg: TrainConfig) -> float:
    """How long ranks 1.. may wait in a collective for rank 0. Rank 0's longest stretch away
    from the group is a batch wait (trainer.get_batch_timeout_s) into which a re-sync of a
    restarted engine may fall: waiting for it to come up (rollout.startup_timeout_s), then
    forming the cohort and sending (weight_sync.timeout_s each); then a margin. The bound was
    the batch wait + 300 s: with the 30B preset's 1200 s engine start-up the other ranks failed
    first, with gloo's or NCCL's anonymous timeout, while rank 0 still waited for the engine
    it would have named."""
    return (cfg.trainer.get_batch_timeout_s + cfg.rollout.startup_timeout_s
            + 2 * cfg.weight_sync.timeout_s + 300)


def init_distributed(cfg: TrainConfig) -> torch.device:
    timeout = datetime.timedelta(seconds=collective_timeout_s(cfg))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout)
        device = torch.device("cuda", local)
    else:
        torch.set_num_threads(cfg.trainer.torch_threads)
        dist.init_process_group("gloo", timeout=timeout)
        device = torch.device("cpu")
    collectives.use_device(device)  # NCCL reduces CUDA tensors only
    return device


def broadcast_request(request: str | None) -> str | None:
    """Rank 0's pending control request (runtime/control.py `pending_request`: None, PREEMPT
    or STOP) on every rank."""
    return REQUESTS[collectives.broadcast_int(REQUESTS.index(request))]


def broadcast_after_push(resend: bool, request: str | None) -> tuple[bool, str | None]:
    """Rank 0's two answers after a weight push, on every rank in one broadcast: whether the
    push must be made again from a new export (its stream was spent on a failed sync:
    trainer/main.py push_streamed) and the pending control request."""
    code = collectives.broadcast_int(2 * REQUESTS.index(request) + int(resend))
    return bool(code % 2), REQUESTS[code // 2]


def end_on_request(request: str, done: int) -> int:
    """Say how the run ends on `request` after step `done` (its checkpoint saved); the exit
    code: 0 for a stop (a normal end), PREEMPT_EXIT_CODE for a preemption (requeue)."""
    if request == STOP:
        log.info("stopped on request after step %d: final checkpoint step_%d saved", done, done)
        return 0
    log.info("preempted: checkpoint step_%d saved; exiting for requeue", done)
    return PREEMPT_EXIT_CODE
