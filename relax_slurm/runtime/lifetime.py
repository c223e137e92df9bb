"""How long the launcher's processes live: each dies with the launcher (Linux
PR_SET_PDEATHSIG), and the launcher adopts the orphans among its descendants (Linux
PR_SET_CHILD_SUBREAPER) to stop them, or, forked by the zygote, to wait for them as its own
(launch/processes.py, runtime/zygote.py)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def adopt_orphans() -> bool:
    """Make this process the parent of every orphan among its descendants (Linux
    PR_SET_CHILD_SUBREAPER), so `ProcessSet` can find and stop them; False elsewhere. Called
    by the launchers' entry points only: a subreaper must reap what it adopts."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def adopts_orphans() -> bool:
    """Whether this process is a child subreaper (`adopt_orphans` took effect): only then can a
    child of it be an orphan it adopted rather than a process it started."""
    if not sys.platform.startswith("linux"):
        return False
    flag = ctypes.c_int(0)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value != 0


def die_with(parent: int) -> None:
    """SIGTERM to this process when its parent, `parent`, dies; leave at once if it already
    has (it died before prctl took effect). Nothing outside Linux."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)


def child_setup(parent: int, cpus: list[int] | None):
    """preexec_fn: die with the launcher, then pin to `cpus` (if any)."""
    def setup() -> None:
        die_with(parent)
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup
