"""ProcessSet teardown: it must stop every child and never raise from `finally`."""

from __future__ import annotations

import os
import sys

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
