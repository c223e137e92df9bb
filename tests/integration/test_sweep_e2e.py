"""`relax-train -m` on one machine: every point runs in turn, in its own run directory, and a
failing point does not stop the others (the exit status and the table say it failed)."""

from __future__ import annotations

import json
import subprocess

import pytest

from relax_slurm.config import load_config
from tests.conftest import ONE_RANK, REPO, run_env, tiny_command

STEPS = 2  # no learning claim: each point only has to run to its end
TIMEOUT_S = 600  # two runs of ~10 s idle (start-up + 2 steps); x10 on a slow, busy host


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_local_sweep_runs_every_point_and_survives_a_bad_one(tmp_path, tiny_assets):
    sweep = tmp_path / "sweep"
    # trainer.lr=-1 composes (a float) but fails validation: that point fails, the others run
    cmd = tiny_command(sweep, tiny_assets, ONE_RANK, f"trainer.total_steps={STEPS}",
                       "trainer.lr=1e-5,-1,2e-5")
    cmd.insert(3, "-m")
    proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 1, out  # one point failed
    good = [sweep / "0_trainer.lr=1e-05", sweep / "2_trainer.lr=2e-05"]
    for run_dir, lr in zip(good, (1e-5, 2e-5)):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS, (run_dir, out)
        assert load_config(run_dir / "config.yaml").trainer.lr == lr
    assert not (sweep / "1_trainer.lr=-1" / "summary.json").exists()
    points = json.loads((sweep / "sweep.json").read_text())
    assert [(p["run_dir"], p["state"]) for p in points] == [
        (str(good[0]), "completed"), (str(sweep / "1_trainer.lr=-1"), "failed"),
        (str(good[1]), "completed")]
    assert "trainer.lr" in points[1]["message"]  # the point's error names the field
    assert "3 point(s), 1 failed" in proc.stdout
