"""Ending a run on purpose from another shell (`relax-ctl stop`), through the real launcher and
topology: a tiny run of 1000 steps is stopped a few steps in; the trainer saves a final
checkpoint at the step it reached (the preset saves none on its own: save_every=0), the launcher
exits 0 with a finished run, summary.json records the stop, and the checkpoint is the one a
resume finds. The same for an SFT run (its own loop) on two ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relax_slurm.checkpoint import find_latest
from relax_slurm.runtime.control import request_stop
from tests.conftest import ONE_RANK, REPO, run_env, tiny_command
from tests.integration.test_chaos import finish, start, stop, wait_steps

TOTAL = 1000
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_relax_ctl_stop_ends_a_run_as_finished_with_its_final_checkpoint(tmp_path, tiny_assets):
    run_dir = tmp_path / "run"
    proc = start(run_dir, tiny_assets, ONE_RANK, f"trainer.total_steps={TOTAL}")
    try:
        wait_steps(proc, run_dir, 3)
        ctl = subprocess.run([sys.executable, "-m", "relax_slurm.launch.ctl", "stop",
                              str(run_dir), "--reason", "reward plateaued", "--wait",
                              "--wait-s", "120"],
                             cwd=REPO, capture_output=True, text=True, timeout=180, env=run_env())
    except BaseException:
        stop(proc)  # the launcher and every role
        raise
    assert ctl.returncode == 0, ctl.stderr
    out, err = finish(proc)  # the launcher exits 0: a finished run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert json.loads(ctl.stdout) == summary  # --wait printed the run's summary
    stopped = summary["stopped_early"]
    reached = stopped["at_step"]
    assert stopped == {"at_step": reached, "total_steps": TOTAL, "reason": "reward plateaued"}
    assert 3 <= reached < TOTAL and summary["steps"] == reached, summary
    assert summary["samples_lost"] == 0, summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] + 1 == reached
    assert find_latest(run_dir) == run_dir / "checkpoints" / f"step_{reached}"  # what resumes
    assert f"stopped on request after step {reached}" in (
        run_dir / "logs" / "trainer.log").read_text()
    assert '"stopped_early"' in out and "run directory:" in out  # relax-train's own report


def test_a_stop_ends_an_sft_run_on_every_rank(tmp_path, tiny_assets):
    """SFT's own loop (trainer/sft.py), two DDP ranks: rank 0 reads the request and both leave
    the loop after the same step (a rank left behind would hang in its next collective)."""
    run_dir = tmp_path / "sft"
    cmd = tiny_command(run_dir, tiny_assets, "metrics.progress=false",
                       f"sft.val_files=[{tiny_assets / 'arith_test.jsonl'}]",
                       f"trainer.total_steps={TOTAL}", "trainer.nproc_per_node=2",
                       experiment="tiny_sft_cpu")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=run_env(), start_new_session=True)
    try:
        wait_steps(proc, run_dir, 2)
        request_stop(run_dir, "enough")
    except BaseException:
        stop(proc)
        raise
    finish(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    reached = summary["steps"]
    assert summary["stopped_early"] == {"at_step": reached, "total_steps": TOTAL,
                                        "reason": "enough"}, summary
    assert 2 <= reached < TOTAL
    assert find_latest(run_dir) == run_dir / "checkpoints" / f"step_{reached}"
    assert f"stopped on request after step {reached}" in (
        run_dir / "logs" / "trainer.log").read_text()
