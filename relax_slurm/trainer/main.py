"""Trainer entry point, run by torchrun: `torchrun ... -m relax_slurm.trainer --run-dir DIR`.

Each step: take a batch from the broker, train on it, push the new weights to the engines,
checkpoint on its cadence, bump the policy version on the broker, log one metrics line. Rank 0
alone talks to the broker and the engines (trainer/lead.py `RankZero`; the other ranks hold a
`Peer` whose calls do nothing) and the others get their shard of the batch from rank 0.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from relax_slurm.checkpoint import checkpoints_dir
from relax_slurm.checkpoint.dcp import wait_pending
from relax_slurm.config import TrainConfig, load_config
from relax_slurm.config.cross_checks import check_batch_divides
from relax_slurm.data_position import Positions, checkpoint_positions
from relax_slurm.runtime.control import STOP
from relax_slurm.runtime.exit import exit_now
from relax_slurm.runtime.heap import freeze_heap
from relax_slurm.runtime.plan import load_plan
from relax_slurm.runtime.stacks import register_stack_dumps
from relax_slurm.trainer import collectives
from relax_slurm.trainer.backend import build_backend
from relax_slurm.trainer.lead import Peer, RankZero, StepClock
from relax_slurm.trainer.ranks import broadcast_after_push, end_on_request, init_distributed
from relax_slurm.trainer.stream import step_blocks

log = logging.getLogger("relax_slurm.trainer")


class Checkpointer:
    """Decides its own cadence: a checkpoint every trainer.save_every steps, at the last step
    and on a preemption or a stop (waited for: the run ends next); an HF export every
    trainer.save_hf_every steps and, when that is set, at a stop (relax-ctl stop,
    trainer.stop_at): the export a run that ended early would otherwise lack."""

    def __init__(self, backend, cfg: TrainConfig, run_dir: Path) -> None:
        self.backend, self.cfg, self.run_dir = backend, cfg, run_dir
        self.root = checkpoints_dir(run_dir)

    def maybe_save(self, done: int, final: bool, extra: Callable[[], dict],
                   stopped: bool = False) -> None:
        t = self.cfg.trainer
        if final or (t.save_every and done % t.save_every == 0):
            # before set_version: in sync mode the worker is idle, so the data position
            # saved is exactly where the next batch starts
            handle = self.backend.save(self.root, done, extra(), keep_last=t.keep_last,
                                       async_save=t.async_save, hf_assets_src=self.cfg.model.path)
            if final:
                handle.wait()
        if t.save_hf_every and (done % t.save_hf_every == 0 or stopped):
            self.backend.save_hf(self.run_dir / "hf" / f"step_{done}")


def push_streamed(lead: RankZero | Peer, push: Callable, backend, version: int
                  ) -> tuple[dict, str | None]:
    """`push(weights, version)` of the backend's export (read as the ranks gather it when
    `lead.streams`), again while rank 0 says the stream was spent on a failed sync (the
    cohort re-formed: weightsync/cohort.py); every rank makes each export, in step. Returns
    the push's stats and rank 0's pending control request, told with the resend answer in
    one broadcast."""
    while True:
        out = push(backend.engine_weights(stream=lead.streams), version)
        resend, request = broadcast_after_push(lead.take_resend(), lead.control_request())
        if not resend:
            return out, request


def train_loop(cfg: TrainConfig, backend, lead: RankZero | Peer, saver: Checkpointer,
               start_step: int, positions: Positions, device: torch.device) -> int:
    """The steps from `start_step` to trainer.total_steps, or to a control request (preempt,
    stop: runtime/control.py) after its final checkpoint; the exit code (PREEMPT_EXIT_CODE after
    a preemption, 0 at the end and after a stop)."""
    push_streamed(lead, lead.start, backend, start_step)
    clock = StepClock()
    # rank 0 re-sends to a restarted engine on its own where it holds whole tensors
    local_weights = backend.local_weights()
    for step in range(start_step, cfg.trainer.total_steps):
        clock.begin()
        stream = lead.open_stream(step, local_weights)
        # an overlapped push of the previous version ends before the weights change
        blocks = step_blocks(stream, backend.pad_id, device, backend.data_ranks,
                             cfg.trainer.num_steps_per_rollout)
        train = backend.train_step(blocks, before_update=lead.settle)
        if cfg.rollout.release_memory_during_train:  # the engines wake on these GPUs next
            backend.release_step_memory()
        clock.mark("trained")
        lead.note_positions(positions)
        done = step + 1
        # the export is a collective under FSDP2 and megatron (gathered over TP/PP); with
        # model.lora the adapter alone (trainer/lora.py)
        # rank 0 reads the control request (preempt, stop); every rank gets it here
        sync, request = push_streamed(lead, lead.push, backend, done)
        clock.mark("synced")
        saver.maybe_save(done, final=request is not None or done == cfg.trainer.total_steps,
                         extra=lambda: lead.checkpoint_extra(positions, done),
                         stopped=request == STOP)
        clock.mark("saved")
        lead.finish_step(step, train, clock, sync)
        clock.end()
        if request is not None:
            lead.settle()
            wait_pending()
            return end_on_request(request, done)
    lead.settle()
    wait_pending()
    return 0


def run(run_dir: Path) -> int:
    cfg = load_config(run_dir / "config.yaml")
    plan = load_plan(run_dir)
    if cfg.supervised:  # algo=sft: the trainer alone, on a dataset (trainer/sft.py)
        from relax_slurm.trainer.sft import run_sft

        return run_sft(cfg, plan, run_dir)
    device = init_distributed(cfg)
    torch.manual_seed(cfg.trainer.seed)
    backend = build_backend(cfg, device)  # trainer.backend: model, optimizer, checkpoints
    data_world = len(set(backend.data_ranks))
    check_batch_divides(cfg.rollout, cfg.trainer, data_world)
    start_step, extra = 0, {}
    if plan.resume_from:
        extra = backend.load(plan.resume_from)
        start_step = extra["step"]
        log.info("resumed from %s at step %d", plan.resume_from, start_step)
    freeze_heap()
    lead = (RankZero(cfg, plan, run_dir, start_step, data_world) if dist.get_rank() == 0
            else Peer())
    try:
        return train_loop(cfg, backend, lead, Checkpointer(backend, cfg, run_dir), start_step,
                          checkpoint_positions(extra), device)
    finally:
        lead.close()
        backend.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    # its stacks on SIGUSR2 (relax-ctl dump); torchrun gives each rank RANK, SFT's too
    register_stack_dumps(args.run_dir, f"trainer-rank{os.environ.get('RANK', '0')}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(message)s")
    exit_now(run(args.run_dir))  # run() closed everything; skip seconds of interpreter teardown


if __name__ == "__main__":
    main()
