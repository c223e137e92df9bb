"""runtime/stacks.py in a real process: registered, it writes the stacks of all its threads to
its file on SIGUSR2 and goes on running; unregistered (no run dir), it registers nothing."""

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


def _start(tmp_path: Path, run_dir: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ROLE, run_dir], cwd=REPO, env=run_env(),
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
        assert "Current thread" in text and "Thread 0x" in text  # all threads
        assert 'File "<string>"' in text
    finally:
        proc.kill()
        proc.wait(timeout=30)


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
