"""Control requests to a running run, as files in `RUN_DIR/control/`: one process asks, another
acts when it next looks.

Preemption: the Slurm driver gets `SIGUSR1` some time before the job's end (`#SBATCH
--signal=B:USR1@<cluster.signal_lead_s>`) and calls `request_preempt(run_dir)`. The trainer checks
`preempt_requested(run_dir)` after every step; when set it saves a checkpoint into
`run_dir/checkpoints/` and exits with `PREEMPT_EXIT_CODE`. The supervisor turns that exit into
`Preempted`, the driver requeues the job, and the next attempt calls `clear_preempt` before it
starts the roles again and resumes from the checkpoint (`resume=auto`).

Stop: `relax-ctl stop RUN_DIR` calls `request_stop(run_dir, reason)` to end a run for good
before trainer.total_steps (the reward has plateaued). The trainer reads the same way
(`pending_request`, after every step, rank 0, broadcast to every rank): it saves a final
checkpoint and exits 0. The supervisor accepts the early end (summary.json's `stopped_early`),
so the run is finished: not failed, not requeued. A stop outranks a preemption that arrives
with it. Every new run or attempt calls `clear_stop` with `clear_preempt`: a stop file left by
an earlier run does not end a resumed one at its first step.

Status: the Slurm driver records each attempt's outcome in `RUN_DIR/slurm_status.json`
(`write_status`); `relax-train cluster.wait=true` reads it (`read_status`) once the job is gone.

A file rather than a signal: it reaches every rank on every node of a shared filesystem, it
survives the race where the request comes before the trainer has started, and it is plain to
inspect (`ls run_dir/control`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

PREEMPT_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", which is what a preempted run is
CONTROL_DIR = "control"
PREEMPT_FILE = "preempt"
STOP_FILE = "stop"
PREEMPT, STOP = "preempt", "stop"  # pending_request's answers (None: carry on)
REQUESTS = (None, PREEMPT, STOP)
STATUS_FILE = "slurm_status.json"
STATES = ("running", "completed", "failed", "requeued", "preempted", "terminated")


def preempt_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CONTROL_DIR / PREEMPT_FILE


def request_preempt(run_dir: str | Path, reason: str = "preempt") -> Path:
    """Ask the trainer to checkpoint and exit after its current step (idempotent)."""
    path = preempt_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{PREEMPT_FILE}.{os.getpid()}")
    tmp.write_text(f"{reason} requested at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    tmp.replace(path)  # atomic: a reader sees no file or a whole one
    return path


def preempt_requested(run_dir: str | Path) -> bool:
    return preempt_path(run_dir).exists()


def clear_preempt(run_dir: str | Path) -> None:
    preempt_path(run_dir).unlink(missing_ok=True)


def stop_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CONTROL_DIR / STOP_FILE


def request_stop(run_dir: str | Path, reason: str = "requested") -> Path:
    """Ask the trainer to save a final checkpoint and end the run after its current step
    (idempotent; the last reason given is kept)."""
    path = stop_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{STOP_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"reason": reason, "time": time.time(),
                               "requested_at": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    tmp.replace(path)  # atomic: a reader sees no file or a whole one
    return path


def stop_requested(run_dir: str | Path) -> bool:
    return stop_path(run_dir).exists()


def read_stop(run_dir: str | Path) -> dict | None:
    """The stop request on file ({"reason", "time", "requested_at"}), None without one."""
    try:
        text = stop_path(run_dir).read_text()
    except FileNotFoundError:
        return None
    try:
        request = json.loads(text)
    except json.JSONDecodeError:  # written by hand (`touch`, `echo why >`): still a request
        request = None
    return request if isinstance(request, dict) else {"reason": text.strip() or "requested"}


def clear_stop(run_dir: str | Path) -> None:
    stop_path(run_dir).unlink(missing_ok=True)


def pending_request(run_dir: str | Path) -> str | None:
    """The control request the trainer acts on after a step: STOP, PREEMPT or None."""
    if stop_requested(run_dir):
        return STOP
    return PREEMPT if preempt_requested(run_dir) else None


def write_status(run_dir: str | Path, state: str, **info: object) -> None:
    """Record the driver's state (one of STATES) with `info` (job_id, attempt, message)."""
    assert state in STATES, state
    path = Path(run_dir) / STATUS_FILE
    tmp = path.with_name(f".{STATUS_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"state": state, "time": time.time(), **info}, indent=2) + "\n")
    tmp.replace(path)


def read_status(run_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
