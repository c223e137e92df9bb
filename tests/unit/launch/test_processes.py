"""ProcessSet teardown: it must stop every child and never raise from `finally`."""

from __future__ import annotations

import os
import signal
import sys
import time

from relax_slurm.launch.processes import ProcessSet
from tests.helpers_tiny import alive


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
        while alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(rank)
    finally:
        if alive(rank):
            os.kill(rank, signal.SIGKILL)


# A role shaped like torchrun: its rank runs in a session of its own and forks a writer (as
# megatron's async checkpoint save does); `engine` forks a helper that outlives its own parent
# inside the role's live session. The launcher (adopt_orphans, as relax-train's) SIGKILLs the
# rank, restarts the trainer, then closes the set.
AGENT = """
import os, subprocess, sys, time
out = sys.argv[1]
if sys.argv[2] == "trainer":  # torchrun, and its rank in a session of its own
    subprocess.Popen([sys.executable, __file__, out, "rank"], start_new_session=True)
elif sys.argv[2] == "rank":
    if os.fork() == 0:  # the writer
        time.sleep(600)
        os._exit(0)
    open(out + "/rank.pid.tmp", "w").write(str(os.getpid()))
    os.replace(out + "/rank.pid.tmp", out + "/rank.pid")  # whole, for the launcher to read
elif os.fork() == 0:  # engine: a child that starts a helper and ends, in the role's session
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
    os._exit(0)
time.sleep(600)
"""

LAUNCHER = """
import json, os, signal, sys, time
from pathlib import Path
from relax_slurm.runtime.lifetime import adopt_orphans
from relax_slurm.launch.processes import ProcessSet, children

tmp = Path(sys.argv[1])
agent = str(tmp / "agent.py")
assert adopt_orphans()
procs = ProcessSet(tmp, dict(os.environ))
trainer = procs.start("trainer", [sys.executable, agent, str(tmp), "trainer"])
engine = procs.start("engine", [sys.executable, agent, str(tmp), "engine"])
me, deadline = os.getpid(), time.monotonic() + 60
def adopted():
    return {p for p in children(me) if p not in (trainer.proc.pid, engine.proc.pid)}
while len(adopted()) < 1 or not (tmp / "rank.pid").exists():
    assert time.monotonic() < deadline, "the engine's helper or the rank never started"
    time.sleep(0.05)
(helper,) = adopted()
os.kill(int((tmp / "rank.pid").read_text()), signal.SIGKILL)  # the rank dies mid-save
while len(adopted()) < 2:  # its writer is re-parented here
    assert time.monotonic() < deadline, "the writer was not adopted"
    time.sleep(0.05)
(writer,) = adopted() - {helper}
procs.restart(trainer, [sys.executable, "-c", "import time; time.sleep(600)"])
after_restart = sorted(adopted())
procs.close()
json.dump({"helper": helper, "writer": writer, "after_restart": after_restart,
           "after_close": sorted(children(me))}, open(tmp / "result.json", "w"))
"""


def test_a_dead_ranks_orphaned_writer_is_stopped_with_its_role(tmp_path):
    """A rank SIGKILLed mid-save left megatron's forked checkpoint writer running, re-parented
    to init where no walk from a role found it (seen in the suite; on a GPU it would hold
    memory while the trainer restarts). The launcher adopts orphans: restarting the trainer
    stops the writer and spares a live role's own orphan; close() stops that one too."""
    import json
    import subprocess

    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    subprocess.run([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path)], check=True,
                   timeout=120)
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["after_restart"] == [r["helper"]]  # the writer stopped, the engine's helper kept
    assert r["after_close"] == []
    assert not alive(r["writer"]) and not alive(r["helper"])


def test_a_set_in_a_process_that_adopts_no_orphans_leaves_its_other_children_alone(tmp_path):
    """Only a child subreaper (a launcher) can have adopted orphans; elsewhere (this pytest
    worker, whose other children are other tests' engines and fixtures) every child is one
    the process started itself, and close() once SIGKILLed them all."""
    import subprocess

    from relax_slurm.runtime.lifetime import adopts_orphans

    assert not adopts_orphans()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
    try:
        procs = ProcessSet(tmp_path, dict(os.environ))
        role = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
        procs.close()
        assert _gone(role.proc.pid)
        assert other.poll() is None and alive(other.pid)
    finally:
        other.kill()
        other.wait()
