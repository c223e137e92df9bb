"""Stopping and starting a run again as a user does (issue #22), through the real launcher:
one Ctrl-C keeps a checkpoint (the preset saves none on its own: save_every=0) and names the
command that resumes; that command resumes and says so, its progress counts from the
checkpoint's step to the total; run again when complete it says so and changes nothing; with a
changed lr it is refused, naming the key."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_slurm.checkpoint import find_latest
from tests.conftest import ONE_RANK, REPO, run_env, tiny_command

START_TIMEOUT_S = 300
RUN_TIMEOUT_S = 300


def _default_sigint() -> None:
    # a suite started in the background inherits SIGINT ignored; start as a terminal would
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_a_step(proc: subprocess.Popen, run_dir: Path) -> None:
    """roles.json (written once the launcher takes a Ctrl-C as a request to checkpoint) and a
    first metrics row."""
    deadline = time.monotonic() + START_TIMEOUT_S
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if (run_dir / "roles.json").exists() and metrics.exists() and metrics.read_text():
            return
        time.sleep(0.2)
    raise AssertionError("the run made no step in time")


def kill_roles(run_dir: Path) -> None:
    roles = run_dir / "roles.json"
    for r in json.loads(roles.read_text()) if roles.exists() else []:
        try:
            os.killpg(r["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def relax_train_line(command: str, *extra: str) -> subprocess.CompletedProcess:
    """Run a printed `relax-train ...` command line (as this checkout's module)."""
    argv = shlex.split(command)
    assert argv[0] == "relax-train", command
    return subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", *argv[1:], *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=run_env())


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_the_named_command_resumes(tmp_path, tiny_assets):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        tiny_command(run_dir, tiny_assets, ONE_RANK, "trainer.total_steps=1000"), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env(),
        preexec_fn=_default_sigint)
    try:
        wait_for_a_step(proc, run_dir)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_roles(run_dir)
    assert proc.returncode == 130, err[-3000:]
    ckpt = find_latest(run_dir)
    assert ckpt is not None, err[-3000:]
    step = int(ckpt.name.removeprefix("step_"))
    assert f"checkpoint kept: {ckpt}" in err, err[-3000:]
    command = re.search(r"^resume with: (.*)$", err, re.M).group(1)

    total = step + 2  # a run length is one of the keys a resume may change
    resumed = relax_train_line(command, f"trainer.total_steps={total}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {ckpt} (step {step} of {total})" in resumed.stderr
    shown = [tuple(map(int, m)) for m in re.findall(r"^step (\d+)/(\d+) ", resumed.stdout, re.M)]
    assert shown and shown[-1] == (total, total), resumed.stdout[-2000:]
    assert all(step < done <= total == of for done, of in shown), shown
    summary = (run_dir / "summary.json").read_text()

    again = relax_train_line(command, f"trainer.total_steps={total}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run complete at step {total}" in again.stderr and "nothing to do" in again.stderr
    assert (run_dir / "summary.json").read_text() == summary

    changed = relax_train_line(command, f"trainer.total_steps={total + 2}", "trainer.lr=1e-3")
    assert changed.returncode == 1
    assert "trainer.lr 0.002 -> 0.001" in changed.stderr, changed.stderr[-3000:]
    assert "resume_with_changes=true" in changed.stderr
    history = [json.loads(x) for x in (run_dir / "config_history.jsonl").read_text().splitlines()]
    assert [h["from_step"] for h in history] == [0, step]
    assert history[1]["changes"]["trainer.total_steps"] == {"old": 1000, "new": total}
