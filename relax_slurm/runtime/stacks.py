"""Stack dumps on demand: every role writes the Python stacks of all its threads when it gets
`DUMP_SIGNAL` (SIGUSR2), without stopping.

Each role calls `register_stack_dumps(run_dir, role)` first thing in its entry point. That
opens `RUN_DIR/diagnostics/stacks/<role>-<pid>.txt` in append mode, writes one header line
(role, pid, host, start time), blocks DUMP_SIGNAL in the calling thread (and so in every
thread it starts later) and starts a daemon thread that takes the signal with
`signal.sigwait` and writes one dump per signal: every thread's stack from
`sys._current_frames()`, read under the interpreter's thread-list lock. Because that thread
waits for the signal itself, it answers while the main thread is blocked in a lock, a socket
or a collective (anything that releases the GIL); it cannot answer while the process is
stopped (SIGSTOP, a debugger) or while a C call holds the GIL.

Why not faulthandler's C handler (the earlier design): it walks the thread list
from inside the signal handler without any lock, and a thread that starts or ends meanwhile
(a weight push's thread, a checkpoint's commit thread: every step of the trainer) makes it
read freed memory. `relax-ctl dump` killed a training rank with SIGSEGV that way on this
machine (tests/slurm's preemption run; tests/unit/runtime/test_stacks.py reproduces it in
~30 signals against a process churning threads).

A thread started before the registration (one a C library made at import) does not block the
signal, and the kernel may hand the signal to it: the Python-level handler installed here
then writes the same dump from the main thread, at its next bytecode. The block is inherited
by child processes (fork and exec): a child that registers takes its own signals, one that
does not keeps SIGUSR2 pending and harmless; `forget_stack_dumps()` gives a forked child that
keeps running Python the default back.

The file is the registration: `relax-ctl dump` (launch/dump.py) signals only processes that
have one, because SIGUSR2's default action ends a process that has not registered (a role
still importing, an external SGLang engine). The file appears under its name only once the
thread is waiting (written under a hidden name, then renamed).

Why SIGUSR2: SIGUSR1 is Slurm's warning to the driver before a preemption or time limit,
SIGTERM/SIGINT stop roles, and torchrun's agent forwards only SIGTERM, SIGINT, SIGHUP and
SIGQUIT to its ranks (`--signals-to-handle`), so it neither uses nor relays SIGUSR2: the
launcher signals the ranks itself (they are the agent's children).

Roles whose command line carries no run directory (the hf engine, the trainer's torchrun
agent) read it from `RUN_DIR_ENV`, which the launcher sets in every role's environment.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

DUMP_SIGNAL = signal.SIGUSR2
RUN_DIR_ENV = "RELAX_RUN_DIR"
DIAGNOSTICS_DIR = "diagnostics"
STACKS_DIR = "stacks"
HEADER = "# relax-slurm stack dumps"
MAX_DEPTH = 100  # frames per thread, as faulthandler: a runaway recursion stays readable
THREAD_NAME = "relax-stack-dumps"

_registered: IO[str] | None = None  # kept open (and referenced) for the process's life
_waiter: threading.Thread | None = None  # the thread that takes the signal (one per process)
_write_lock = threading.RLock()  # one dump at a time; re-entrant: a handler may interrupt one


def stacks_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / DIAGNOSTICS_DIR / STACKS_DIR


def register_stack_dumps(run_dir: str | Path | None, role: str) -> Path | None:
    """Write this process's stacks to its file in `run_dir` on every DUMP_SIGNAL; the file's
    path (None without a run directory: a role started by hand outside a run). Call it from
    the main thread, before the role starts threads of its own."""
    global _registered, _waiter
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
    _registered = f
    signal.signal(DUMP_SIGNAL, _on_signal)  # before the block: never a window of SIG_DFL
    signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})
    if _waiter is None or not _waiter.is_alive():  # registered again: the new file, one waiter
        _waiter = threading.Thread(target=_answer_signals, name=THREAD_NAME, daemon=True)
        _waiter.start()
    hidden.replace(path)  # the same open file: the name says "registered" only from now on
    return path


def forget_stack_dumps() -> None:
    """In a forked child that goes on running Python: SIGUSR2's default back, unblocked (the
    parent's waiting thread did not survive the fork; its file is the parent's)."""
    global _registered
    _registered = None
    signal.signal(DUMP_SIGNAL, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {DUMP_SIGNAL})


def _answer_signals() -> None:
    while True:
        signal.sigwait({DUMP_SIGNAL})
        write_dump()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    write_dump()  # the signal reached a thread that does not block it: the main thread writes


def write_dump() -> None:
    """One dump of every thread's stack into the registered file (a no-op without one)."""
    f = _registered
    if f is None:
        return
    text = format_stacks(sys._current_frames(), threading.get_ident())
    with _write_lock:
        f.write(text)
        f.flush()


def format_stacks(frames: dict[int, FrameType], current: int) -> str:
    """faulthandler's layout (a block per thread, most recent call first, `File "PATH", line N
    in FUNC`) with each thread's name; the main thread first, the dump's own thread left out
    and its frames dropped where the main thread writes the dump."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out, shown = [], 0
    for ident in sorted(frames, key=lambda i: i != main):
        name = names.get(ident, "?")
        if name == THREAD_NAME:
            continue
        frame: FrameType | None = frames[ident]
        if ident == current:  # the main thread in _on_signal: start below this module
            while frame is not None and frame.f_code.co_filename == __file__:
                frame = frame.f_back
        label = "Main thread" if ident == main else "Thread"
        out.append(f'{label} 0x{ident:016x} "{name}" (most recent call first):')
        shown += 1
        for _ in range(MAX_DEPTH):
            if frame is None:
                break
            code = frame.f_code
            out.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
            frame = frame.f_back
        if frame is not None:
            out.append("  ...")
        out.append("")
    return "\n".join([f"# dump at {stamp}: {shown} threads", *out]) + "\n"


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
