"""ProcessSet teardown: it must stop every child and never raise from `finally`."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from relax_slurm.launch.processes import ProcessSet


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_close_reaps_a_child_whose_popen_lock_was_left_taken(tmp_path):
    """A KeyboardInterrupt inside Popen.poll can leave its waitpid lock taken (CI, session 3):
    Popen.wait then always times out. close() must still reap the child and not raise."""
    procs = ProcessSet(tmp_path, dict(os.environ))
    role = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    assert role.proc._waitpid_lock.acquire(False)  # what the interrupted poll left behind
    procs.close()  # raised subprocess.TimeoutExpired before the fix
    assert _gone(role.proc.pid)


def test_close_stops_a_child_that_ignores_sigterm(tmp_path):
    procs = ProcessSet(tmp_path, dict(os.environ))
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    role = procs.start("stubborn", [sys.executable, "-c", code])
    procs.close()
    assert role.proc.returncode is not None and _gone(role.proc.pid)


def _alive(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie is init's to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_close_stops_a_stopped_grandchild_in_its_own_session(tmp_path):
    """torchrun starts each rank in a session of its own, out of reach of the role's killpg; a
    rank frozen by SIGSTOP handles no SIGTERM, and once torchrun was SIGKILLed it stayed, an
    orphan, after its run (found after the chaos tests' frozen trainer)."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
            "start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    procs = ProcessSet(tmp_path, dict(os.environ))
    procs.start("agent", [sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    rank = int(pid_file.read_text())
    try:
        os.kill(rank, signal.SIGSTOP)
        procs.close()
        deadline = time.monotonic() + 10
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank)
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)
