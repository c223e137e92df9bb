"""Ctrl-C and SIGTERM of `relax-train` (local runs): the first keeps the work, a second stops.

The first signal once the roles run takes the preemption path (runtime/control.py): the trainer
saves a checkpoint after its current step and exits, then every role stops, and relax-train
names the checkpoint and the command that resumes from it. A second signal (or one before the
roles are up) stops every role at once (KeyboardInterrupt, children stopped in `finally`).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from relax_slurm.checkpoint.resume import find_latest
from relax_slurm.runtime.control import request_preempt

# overrides that would not resume this run if typed again: resume=PATH/none, overwrite=true
NOT_FOR_RESUME = ("resume=", "overwrite=", "+resume=", "+overwrite=")


class GracefulStop:
    """The SIGINT/SIGTERM handler of relax-train; `arm` once there is a trainer to ask."""

    def __init__(self) -> None:
        self.run_dir: Path | None = None
        self.requested = False

    def arm(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def disarm(self) -> None:
        self.run_dir = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.run_dir is None or self.requested:
            raise KeyboardInterrupt
        self.requested = True
        request_preempt(self.run_dir, "interrupt")
        print("relax-train: stopping: the trainer saves a checkpoint after its current step, "
              "then every role stops (Ctrl-C again stops at once, without it)",
              file=sys.stderr, flush=True)


STOP = GracefulStop()


def resume_command(argv: list[str], run_dir: Path) -> str:
    """The relax-train command line that resumes this run: the same overrides (so the same
    config), run_dir pinned, and no resume=/overwrite= (resume=auto finds its checkpoint)."""
    args = [a for a in argv if not a.startswith(NOT_FOR_RESUME)]
    if not any(a.startswith(("run_dir=", "+run_dir=")) for a in args):
        args.append(f"run_dir={run_dir}")
    return " ".join(["relax-train", *map(shlex.quote, args)])


def kept_message(argv: list[str], run_dir: Path, pressed_twice: bool = True) -> str:
    """What an interrupted run kept, and how to go on from it. `pressed_twice`: a second
    signal stopped it (the advice to press once applies); else the first came before the
    trainer ran, with nothing to save yet."""
    latest = find_latest(run_dir)
    if latest is None:
        once = "one Ctrl-C, not two, saves one after the current step; " if pressed_twice else ""
        return (f"no checkpoint in {run_dir / 'checkpoints'}: the same command starts again "
                f"from step 0 ({once}trainer.save_every=N saves every N steps)")
    return f"checkpoint kept: {latest}\nresume with: {resume_command(argv, run_dir)}"


def stopped_message(argv: list[str], run_dir: Path, pressed_twice: bool) -> str:
    """What relax-train prints when a signal stopped every process at once: a second one, or
    the first before the roles were up (start-up), when there was no trainer to ask."""
    head = ("relax-train: interrupted again; every process of the run was stopped at once"
            if pressed_twice else "relax-train: interrupted during start-up, before the trainer "
            "ran (nothing to checkpoint yet); every process started was stopped")
    return head + (f"\n{kept_message(argv, run_dir, pressed_twice)}" if run_dir.is_dir() else "")
