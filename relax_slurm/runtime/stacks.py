"""Stack dumps on demand: every role writes the Python stacks of all its threads when it gets
`DUMP_SIGNAL` (SIGUSR2), without stopping.

Each role calls `register_stack_dumps(run_dir, role)` first thing in its entry point. That
opens `RUN_DIR/diagnostics/stacks/<role>-<pid>.txt` in append mode, writes one header line
(role, pid, host, start time) and hands the file to `faulthandler.register(DUMP_SIGNAL, ...,
all_threads=True, chain=False)`: the interpreter's own C handler, which writes the stacks from
inside the signal handler (with SA_RESTART, which chain=True would drop: a system call the signal
lands in resumes instead of failing with EINTR), so it answers while the main thread is blocked in a lock, a socket
or a collective (it cannot answer while the process is stopped: SIGSTOP, a debugger). The
file is the registration: `relax-ctl dump` (launch/dump.py) signals only processes that have
one, because SIGUSR2's default action ends a process that has not registered (a role still
importing, a reward worker, an external SGLang engine). The file appears under its name only
once the handler is in place (written under a hidden name, then renamed).

Why SIGUSR2: SIGUSR1 is Slurm's warning to the driver before a preemption or time limit,
SIGTERM/SIGINT stop roles, and torchrun's agent forwards only SIGTERM, SIGINT, SIGHUP and
SIGQUIT to its ranks (`--signals-to-handle`), so it neither uses nor relays SIGUSR2: the
launcher signals the ranks itself (they are the agent's children).

Roles whose command line carries no run directory (the hf engine, the trainer's torchrun
agent) read it from `RUN_DIR_ENV`, which the launcher sets in every role's environment.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

DUMP_SIGNAL = signal.SIGUSR2
RUN_DIR_ENV = "RELAX_RUN_DIR"
DIAGNOSTICS_DIR = "diagnostics"
STACKS_DIR = "stacks"
HEADER = "# relax-slurm stack dumps"

_registered: IO[str] | None = None  # kept open (and referenced) for the process's life


def stacks_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / DIAGNOSTICS_DIR / STACKS_DIR


def register_stack_dumps(run_dir: str | Path | None, role: str) -> Path | None:
    """Write this process's stacks to its file in `run_dir` on every DUMP_SIGNAL; the file's
    path (None without a run directory: a role started by hand outside a run)."""
    global _registered
    if run_dir is None:
        return None
    folder = stacks_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    path = folder / f"{role}-{pid}.txt"
    hidden = folder / f".{role}-{pid}.txt"
    f = hidden.open("a")
    # Slurm's node name where there is one: the dump's srun asks for that node by it, and a
    # node's hostname need not be its Slurm name (FQDN, or several slurmds on one machine)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    f.write(f"{HEADER}: role={role} pid={pid} host={host} "
            f"started={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} "
            f"signal={DUMP_SIGNAL.name}\n")
    f.flush()
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    hidden.replace(path)  # the same open file: the name says "registered" only from now on
    _registered = f
    return path


@dataclass(frozen=True)
class Registration:
    """One process's stacks file, as its header line describes it."""
    role: str
    pid: int
    host: str
    started: str
    path: Path


def read_registration(path: Path) -> Registration | None:
    """The header of a stacks file; None for a file that is not one (or not yet whole)."""
    try:
        with path.open() as f:
            line = f.readline()
    except OSError:
        return None
    if not line.startswith(HEADER + ":") or not line.endswith("\n"):
        return None
    fields = dict(kv.split("=", 1) for kv in line[len(HEADER) + 1:].split() if "=" in kv)
    try:
        return Registration(fields["role"], int(fields["pid"]), fields["host"],
                            fields["started"], path)
    except (KeyError, ValueError):
        return None


def registrations(run_dir: str | Path) -> list[Registration]:
    """Every process of the run that registered (dead ones too: their files stay)."""
    folder = stacks_dir(run_dir)
    if not folder.is_dir():
        return []
    found = (read_registration(p) for p in sorted(folder.glob("[!.]*.txt")))
    return [r for r in found if r is not None]
