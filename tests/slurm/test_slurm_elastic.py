"""Elastic rollout on a real slurmctld, one run of the tiny experiment (one trainer rank) as a
het job from relax-train: `relax-ctl scale-out --num-replicas 2` mid-run submits the new engine
as its own Slurm job (launch/engine_job.py), which serves the trainer's current weights and
generates for the run; `relax-ctl scale-in --num-replicas 1` drains it and cancels its job.
The run ends with samples_lost 0 and no engine job left in the queue.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.slurm.conftest import SETUP_ALLOWANCE_S
from tests.slurm.test_slurm_runs import (
    diagnose, in_queue, job_env, read_rows, slurm, tiny_overrides, wait_until,
)

pytestmark = pytest.mark.slurm

STEPS = 110  # scale-in ends near step 60 here (~0.7 s a step on a loaded 2-core machine)
RUN_TIMEOUT_S = 900
OP_TIMEOUT_S = 300


def ctl(env: dict, run_dir: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "relax_slurm.launch.ctl", *args[:1], str(run_dir),
                        *args[1:]], env=env, capture_output=True, text=True,
                       timeout=OP_TIMEOUT_S + 60)
    assert r.returncode == 0, r.stdout + r.stderr + "\n" + diagnose(run_dir)
    return json.loads(r.stdout)


def job_state(env: dict, job_id: str) -> str:
    r = slurm(env, "sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State")
    return r.stdout.strip().split()[0] if r.stdout.strip() else ""


@pytest.mark.timeout(RUN_TIMEOUT_S + 180 + SETUP_ALLOWANCE_S)
def test_scale_out_submits_an_engine_job_then_drains_and_cancels_it(tmp_path, tiny_assets,
                                                                     slurm_env):
    run_dir, name = tmp_path / "run", f"relax-test-{uuid.uuid4().hex[:8]}"
    env = job_env(slurm_env)
    cmd = [sys.executable, "-m", "relax_slurm.launch.cli",
           *tiny_overrides(tiny_assets, run_dir, STEPS), "metrics.progress=false",
           "rollout.groups_per_request=8",  # several requests a step: both engines get some
           "cluster.heartbeat_interval_s=1", "cluster.elastic_drain_timeout_s=120",
           "cluster=slurm", "cluster.wait=true", "cluster.wait_poll_s=2",
           f"cluster.job_name={name}", "cluster.time_limit_min=30",
           "cluster.engine_job_cpus=2", "cluster.engine_job_time_min=20"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    why = lambda: diagnose(run_dir)  # noqa: E731
    try:
        wait_until(lambda: len(read_rows(run_dir)) >= 2 or proc.poll() is not None, 600,
                   "2 training steps", why=why)
        assert proc.poll() is None, why()
        [first] = json.loads((run_dir / "plan.json").read_text())["engine_urls"]
        version_at_request = ctl(env, run_dir, "status")["version"]
        op = ctl(env, run_dir, "scale-out", "--num-replicas", "2", "--wait")
        assert op["status"] == "ACTIVE", (op, why())
        assert op["history"] == ["PENDING", "CREATING", "HEALTH_CHECKING", "WEIGHT_SYNCING",
                                 "ACTIVE"]
        [new] = op["urls"]
        info = json.loads((run_dir / "engines" / "engine1.json").read_text())
        assert info["url"] == new and new != first
        job_id = str(info["job_id"])
        assert in_queue(env, job_id)  # its own job, not a step of the run's
        # it serves the trainer's weights, not model.path's version 0
        secret = (run_dir / "secret").read_text().strip()
        version = int(httpx.get(new + "/get_weight_version", timeout=10, headers={
            "Authorization": f"Bearer {secret}"}).json()["weight_version"])
        assert version >= max(version_at_request, 1)
        # and generates for the run
        wait_until(lambda: ctl(env, run_dir, "status")["roles"]["rollout"].get(
            "requests_per_engine", {}).get(new, 0) >= 2 or proc.poll() is not None,
            OP_TIMEOUT_S, "requests on the new engine", why=why)
        assert proc.poll() is None, why()
        # scale in to 1: drained, then its job cancelled
        op = ctl(env, run_dir, "scale-in", "--num-replicas", "1", "--wait")
        assert op["status"] == "COMPLETED" and "drain timeout" not in " ".join(op["history"]), op
        assert ctl(env, run_dir, "engines")["routable"] == [first]
        wait_until(lambda: not in_queue(env, job_id), 60, f"engine job {job_id} to end", why=why)
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        slurm(env, "scancel", f"--name={name}")
        slurm(env, "scancel", f"--name={name}-engine1")
    assert proc.returncode == 0, out[-3000:] + "\n" + why()
    state = wait_until(lambda: job_state(env, job_id) or None, 60, "sacct's row of the job")
    assert state.startswith(("CANCELLED", "COMPLETED")), state
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["samples_lost"] == 0, summary
    driver_log = next(run_dir.glob("slurm-*.out")).read_text()
    assert f"cancelled the Slurm job {job_id} of engine1" in driver_log, driver_log[-3000:]
    assert "weight-sync cohort: engines" in (run_dir / "logs" / "trainer.log").read_text()
