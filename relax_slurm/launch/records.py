"""What the launcher writes about a run's roles: RUN_DIR/roles.json (every role's process or
Slurm job, rewritten after each change: `write_roles`) and RUN_DIR/restarts.jsonl (one line per
restart, in place, global or a requeue: `record_restart`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from relax_slurm.launch.processes import ProcessSet

RESTARTS_FILE = "restarts.jsonl"


def write_roles(procs: ProcessSet, run_dir: Path) -> None:
    path = run_dir / "roles.json"
    tmp = path.with_suffix(".tmp")
    rows = [r.info() for r in procs.roles] + list(procs.outside.values())
    tmp.write_text(json.dumps(rows, indent=2))
    tmp.replace(path)  # readers see the old file or the new one


def record_restart(run_dir: Path, row: dict) -> None:
    with (run_dir / RESTARTS_FILE).open("a") as f:
        f.write(json.dumps({"time": time.time(), **row}) + "\n")
