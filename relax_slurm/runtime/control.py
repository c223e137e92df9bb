"""Control requests to a running run, as files in `RUN_DIR/control/`: one process asks, another
acts when it next looks.

Preemption: the Slurm driver gets `SIGUSR1` some time before the job's end (`#SBATCH
--signal=B:USR1@<cluster.signal_lead_s>`) and calls `request_preempt(run_dir)`. The trainer checks
`preempt_requested(run_dir)` after every step; when set it saves a checkpoint into
`run_dir/checkpoints/` and exits with `PREEMPT_EXIT_CODE`. The supervisor turns that exit into
`Preempted`, the driver requeues the job, and the next attempt calls `clear_preempt` before it
starts the roles again and resumes from the checkpoint (`resume=auto`).

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
