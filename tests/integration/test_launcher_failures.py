"""The launcher fails loudly on a dead role and stops everything it started, on death or Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from relax_slurm.runtime.zygote import use_zygote
from tests.conftest import REPO, run_env, tiny_command
from tests.helpers_tiny import alive

START_TIMEOUT_S = 300


def _default_sigint() -> None:
    # a suite started in the background (`cmd &` without job control) inherits SIGINT ignored,
    # and Python keeps an ignored SIGINT ignored: the launcher must start as a terminal would
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_run(run_dir: Path, tiny: Path) -> subprocess.Popen:
    # no restarts in place: a dead role ends the run (what these tests are about)
    cmd = tiny_command(run_dir, tiny, "trainer.total_steps=100000", "cluster.restart.max_per_role=0")
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=run_env(), preexec_fn=_default_sigint)


def wait_for_first_step(proc: subprocess.Popen, run_dir: Path) -> list[dict]:
    deadline = time.monotonic() + START_TIMEOUT_S
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if (run_dir / "roles.json").exists() and metrics.exists() and metrics.read_text():
            return json.loads((run_dir / "roles.json").read_text())
        time.sleep(0.5)
    raise AssertionError("the run made no step in time")


def processes_of(run_dir: Path) -> list[int]:
    """Every live process whose command line names the run dir (torchrun's ranks included)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(run_dir) in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def assert_all_gone(roles: list[dict], run_dir: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (any(alive(r["pid"]) for r in roles)
                                           or processes_of(run_dir)):
        time.sleep(0.2)
    assert not [r["name"] for r in roles if alive(r["pid"])]
    assert not processes_of(run_dir)


@pytest.fixture
def run(tmp_path, tiny_assets):
    proc = start_run(tmp_path / "run", tiny_assets)
    yield proc, tmp_path / "run"
    if proc.poll() is None:
        proc.kill()
    proc.communicate()
    roles = tmp_path / "run" / "roles.json"
    for r in json.loads(roles.read_text()) if roles.exists() else []:
        if alive(r["pid"]):
            os.killpg(r["pid"], signal.SIGKILL)


@pytest.mark.slow
def test_dead_engine_fails_the_run_naming_it(run):
    proc, run_dir = run
    roles = wait_for_first_step(proc, run_dir)
    engine = next(r for r in roles if r["name"] == "engine0")
    os.kill(engine["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    # the engine itself, or the first role that noticed it, is named with its log
    assert "role '" in err and "log is" in err, err[-2000:]
    assert_all_gone(roles, run_dir)


def forked_from_the_zygote(pid: int) -> bool:
    """Whether torch's library is in the process: the broker and the rollout worker never
    import torch, so only a fork of the zygote, which did, has it (runtime/zygote.py)."""
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow
def test_ctrl_c_stops_every_process(run):
    """Ctrl-C stops every role, and on a machine without a GPU the roles it stops are forks of
    the zygote, under their own command lines: what stops them must reach those too."""
    proc, run_dir = run
    roles = wait_for_first_step(proc, run_dir)
    by_name = {r["name"]: r["pid"] for r in roles}
    for name, module in (("broker", "relax_slurm.broker"), ("rollout", "relax_slurm.rollout")):
        assert forked_from_the_zygote(by_name[name]) == use_zygote(True), name
        cmdline = Path(f"/proc/{by_name[name]}/cmdline").read_bytes().decode()
        assert f"-m {module} " in cmdline, cmdline
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert_all_gone(roles, run_dir)


@pytest.mark.slow
def test_killed_launcher_takes_every_role_with_it(run):
    """SIGKILL runs no `finally`: the roles must still go (PR_SET_PDEATHSIG), not keep a broker,
    an engine and a trainer running with nobody to stop them."""
    proc, run_dir = run
    roles = wait_for_first_step(proc, run_dir)
    proc.kill()
    proc.communicate(timeout=30)
    assert_all_gone(roles, run_dir, timeout_s=60)
