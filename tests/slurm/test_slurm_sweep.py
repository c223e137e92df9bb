"""`relax-train -m ... cluster=slurm cluster.wait=true` on the real slurmctld: each point of the
sweep is its own het job, submitted without waiting for the one before; relax-train then waits
for both and reports each."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from tests.conftest import REPO
from tests.slurm.conftest import SETUP_ALLOWANCE_S
from tests.slurm.test_slurm_runs import diagnose, job_env, slurm, slurm_command

pytestmark = pytest.mark.slurm

STEPS = 2  # no learning claim: each job only has to run to its end
# the test cluster's 3 nodes hold one 2-node het job at a time, so the jobs may run one after
# the other: 36 s for both on an idle machine, minutes on a busy one
RUN_TIMEOUT_S = 1200


@pytest.mark.timeout(RUN_TIMEOUT_S + 120 + SETUP_ALLOWANCE_S)
def test_sweep_submits_one_het_job_per_point(tmp_path, tiny_assets, slurm_env):
    sweep, name = tmp_path / "sweep", f"relax-test-{uuid.uuid4().hex[:8]}"
    env = job_env(slurm_env)
    cmd = slurm_command(tiny_assets, sweep, STEPS, name, "seed=0,1")
    cmd.insert(3, "-m")
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    finally:
        slurm(env, "scancel", f"--name={name}")  # a no-op once the jobs have ended
    run_dirs = [sweep / "0_seed=0", sweep / "1_seed=1"]
    why = proc.stdout[-3000:] + proc.stderr[-3000:] + "\n".join(diagnose(d) for d in run_dirs)
    assert proc.returncode == 0, why
    points = json.loads((sweep / "sweep.json").read_text())
    assert [(p["run_dir"], p["state"]) for p in points] == [(str(d), "completed")
                                                            for d in run_dirs], why
    job_ids = [p["job_id"] for p in points]
    assert len(set(job_ids)) == 2, points
    # both were submitted before relax-train waited for either
    assert proc.stdout.index(f"submitted job {job_ids[1]}") < proc.stdout.index(
        f"job {job_ids[0]}: completed"), why
    for run_dir, job_id, seed in zip(run_dirs, job_ids, (0, 1)):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS, why
        assert summary["slurm"]["job_id"] == job_id and summary["slurm"]["het"], summary
        assert (run_dir / "job.sbatch").read_text().count("#SBATCH hetjob") == 1
        assert f"seed: {seed}\n" in (run_dir / "config.yaml").read_text()
    assert "2 point(s), 0 failed" in proc.stdout
