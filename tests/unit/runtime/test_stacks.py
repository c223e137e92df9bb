"""runtime/stacks.py in a real process: registered, it writes the stacks of all its threads to
its file on SIGUSR2 and goes on running, also while it starts and ends threads all the time (a
trainer's every step) and when the signal lands on a thread older than the registration;
unregistered (no run dir), it registers nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_slurm.runtime.stacks import (DUMP_SIGNAL, read_registration, registrations,
                                        stacks_dir)
from tests.conftest import REPO, run_env

# a role: registers, starts a second thread, says so, then waits in a function of its own
ROLE = """
import sys, threading, time
from relax_slurm.runtime.stacks import register_stack_dumps

ready = threading.Event()

def helper_thread_loop():
    ready.set()
    while True:
        time.sleep(0.05)

def role_main_waits_here():
    path = register_stack_dumps(sys.argv[1] if sys.argv[1] != "-" else None, "broker")
    # the second thread runs before the path is printed (the test signals once it reads it):
    # started after the print, both dumps could come before it existed (seen on a loaded machine)
    threading.Thread(target=helper_thread_loop, daemon=True).start()
    ready.wait()
    print(path, flush=True)
    while True:
        time.sleep(0.05)

role_main_waits_here()
"""
WAIT_S = 60.0  # generous: a loaded 2-core machine starts Pythons slowly


def _start(tmp_path: Path, run_dir: str, script: str = ROLE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, run_dir], cwd=REPO, env=run_env(),
                            stdout=subprocess.PIPE, text=True)


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {WAIT_S}s"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_a_registered_process_writes_its_stacks_on_the_signal_and_goes_on(tmp_path):
    proc = _start(tmp_path, str(tmp_path))
    try:
        path = Path(proc.stdout.readline().strip())
        assert path == stacks_dir(tmp_path) / f"broker-{proc.pid}.txt"
        reg = read_registration(path)
        assert (reg.role, reg.pid) == ("broker", proc.pid)
        assert registrations(tmp_path) == [reg]
        header = path.stat().st_size
        for n in (1, 2):  # every signal appends one more dump
            proc.send_signal(DUMP_SIGNAL)
            _wait_for(lambda: path.read_text().count("role_main_waits_here") == n,
                      f"dump {n}")
        _wait_for(lambda: "helper_thread_loop" in path.read_text(), "the second thread")
        assert proc.poll() is None  # the handler does not end or stop the process
        text = path.read_text()[header:]
        assert 'Main thread 0x' in text and '"MainThread"' in text  # all threads, named
        assert 'Thread 0x' in text and "helper_thread_loop" in text
        assert "relax-stack-dumps" not in text  # the dump's own thread is left out
        assert 'File "<string>"' in text
    finally:
        proc.kill()
        proc.wait(timeout=30)


# threads that start and end without pause while the test signals: faulthandler's C handler
# (the earlier design) walked the thread list unlocked and died with SIGSEGV within ~30 signals
# here (it killed a training rank in tests/slurm's preemption run); the dump thread reads it
# under the interpreter's lock
CHURN = """
import sys, threading, time
from relax_slurm.runtime.stacks import register_stack_dumps

def short_lived():
    sum(range(100))

def churn():
    while True:
        threads = [threading.Thread(target=short_lived) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

path = register_stack_dumps(sys.argv[1], "trainer-rank0")
threading.Thread(target=churn, daemon=True).start()
print(path, flush=True)
while True:
    time.sleep(0.001)
"""
DUMPS = 100  # over three times what the unlocked walk survived (it died at dump 13 here)


@pytest.mark.timeout(300)
def test_dumps_survive_threads_starting_and_ending(tmp_path):
    proc = _start(tmp_path, str(tmp_path), CHURN)
    try:
        path = Path(proc.stdout.readline().strip())
        for n in range(1, DUMPS + 1):
            proc.send_signal(DUMP_SIGNAL)
            # one signal at a time, each answered (pending signals would merge into one);
            # counted by the main thread's bottom frame, once in every dump
            _wait_for(lambda: proc.poll() is not None
                      or path.read_text().count(" in <module>") >= n, f"dump {n}")
            assert proc.poll() is None, f"ended with {proc.returncode} at dump {n}"
        assert "in churn" in path.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)


# a thread started before the registration does not block the signal: the kernel may hand the
# signal to it, and the Python-level handler writes the dump from the main thread instead
EARLY = """
import sys, threading, time
from relax_slurm.runtime.stacks import register_stack_dumps

def started_before_registration():
    while True:
        time.sleep(0.05)

threading.Thread(target=started_before_registration, daemon=True).start()
path = register_stack_dumps(sys.argv[1], "rollout")
print(path, flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.mark.timeout(180)
def test_a_signal_taken_by_an_older_thread_still_dumps(tmp_path):
    proc = _start(tmp_path, str(tmp_path), EARLY)
    try:
        path = Path(proc.stdout.readline().strip())
        for n in (1, 2, 3):
            proc.send_signal(DUMP_SIGNAL)
            _wait_for(lambda: path.read_text().count("# dump at") >= n, f"dump {n}")
        assert proc.poll() is None
        text = path.read_text()
        assert "started_before_registration" in text and "Main thread 0x" in text
        assert "_on_signal" not in text and "write_dump" not in text  # its own frames dropped
    finally:
        proc.kill()
        proc.wait(timeout=30)


# a forked child that runs on (megatron's results manager): SIGUSR2's default again
FORKED = """
import os, signal, sys, time
from relax_slurm.runtime.stacks import DUMP_SIGNAL, forget_stack_dumps, register_stack_dumps

register_stack_dumps(sys.argv[1], "trainer-rank0")
pid = os.fork()
if pid == 0:
    forget_stack_dumps()
    os.kill(os.getpid(), DUMP_SIGNAL)
    time.sleep(30)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_forked_child_that_forgets_gets_the_default_back(tmp_path):
    out = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path)], cwd=REPO,
                         env=run_env(), capture_output=True, text=True, timeout=90)
    assert out.stdout.strip() == str(-DUMP_SIGNAL), out.stderr
    [path] = stacks_dir(tmp_path).glob("trainer-rank0-*.txt")
    assert "# dump at" not in path.read_text()  # the child wrote nothing into the parent's file


@pytest.mark.timeout(180)
def test_without_a_run_dir_nothing_is_registered(tmp_path):
    proc = _start(tmp_path, "-")
    try:
        assert proc.stdout.readline().strip() == "None"
        assert not (tmp_path / "diagnostics").exists()
        proc.send_signal(DUMP_SIGNAL)  # SIGUSR2's default action: the process ends
        assert proc.wait(timeout=WAIT_S) == -signal.SIGUSR2
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_file_without_a_whole_header_is_not_a_registration(tmp_path):
    folder = stacks_dir(tmp_path)
    folder.mkdir(parents=True)
    (folder / "x-1.txt").write_text("# relax-slurm stack dumps: role=x pid=1")  # no newline
    (folder / "y-2.txt").write_text("something else\n")
    (folder / ".z-3.txt").write_text("# relax-slurm stack dumps: role=z pid=3 host=h "
                                     "started=2026-01-01T00:00:00Z\n")  # still hidden
    assert registrations(tmp_path) == []
