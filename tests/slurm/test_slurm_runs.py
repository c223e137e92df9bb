"""The tiny experiment on a real slurmctld: as a het job from relax-train, as a submitit job,
and preempted mid-run through a ready script (requeue, resume, finish).

Each test bounds its time, names its jobs uniquely and cancels them if it gives up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from relax_slurm.checkpoint import find_latest
from relax_slurm.checkpoint.resume import parse_step
from relax_slurm.launch.control import read_status
from tests.conftest import REPO

pytestmark = pytest.mark.slurm

FULL_RUN_TIMEOUT_S = 1800  # 300 steps: ~2 min on an idle machine, far more on a loaded one
PREEMPT_STEPS = 20
ROLE_GROUPS = {"broker": 0, "trainer": 0, "engine0": 1, "rollout": 1}


def tiny_overrides(tiny: Path, run_dir: Path) -> list[str]:
    return ["experiment=tiny_cpu", f"run_dir={run_dir}", f"model.path={tiny / 'model'}",
            f"data.train_files=[{tiny / 'arith_train.jsonl'}]",
            "rollout.startup_timeout_s=1200"]  # a loaded 2-core machine: engines start slowly


def job_env(slurm_env: dict[str, str]) -> dict[str, str]:
    return {**slurm_env, "PYTHONPATH": str(REPO), "RELAX_PYTHON": sys.executable}


def slurm(env: dict, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=60)


def wait_until(pred, timeout_s: float, what: str, poll_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def in_queue(env: dict, job_id: str) -> bool:
    return bool(slurm(env, "squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip())


def step_components(env: dict, job_id: str) -> dict[str, set[int]] | None:
    """Job step name -> het components it ran in, from sacct (None without accounting)."""
    r = slurm(env, "sacct", "-j", job_id, "-D", "-n", "-P", "-o", "JobID,JobName")
    if r.returncode != 0:
        return None
    out: dict[str, set[int]] = {}
    for line in r.stdout.splitlines():
        jid, _, name = line.partition("|")
        if "+" in jid and "." in jid:  # a step of a component: <job>+<k>.<step>
            out.setdefault(name, set()).add(int(jid.split("+")[1].split(".")[0]))
    return out


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() \
        else []


def check_het_run(run_dir: Path, summary: dict, env: dict, job_id: str, steps: int) -> None:
    assert summary["steps"] == steps, summary
    for log in ("broker", "engine0", "rollout", "trainer"):
        assert (run_dir / "logs" / f"{log}.log").stat().st_size > 0, log
    info = summary["slurm"]
    assert info["het"] and info["job_id"] == job_id
    assert set(info["trainer_hosts"]).isdisjoint(info["rollout_hosts"])  # one node per component
    for role, group in ROLE_GROUPS.items():
        assert info["roles"][role]["het_group"] == group, (role, info["roles"][role])
    steps_seen = step_components(env, job_id)
    if steps_seen is not None:  # what Slurm itself recorded: each role ran in its component
        for role, group in ROLE_GROUPS.items():
            assert steps_seen.get(role) == {group}, (role, steps_seen)
    assert summary["reward_first"] <= 0.35, summary
    assert summary["reward_last"] >= 0.8, summary


@pytest.mark.timeout(FULL_RUN_TIMEOUT_S + 120)
def test_relax_train_hetjob_learns(tmp_path, tiny_assets, slurm_env):
    run_dir, name = tmp_path / "run", f"relax-test-{uuid.uuid4().hex[:8]}"
    env = job_env(slurm_env)
    cmd = [sys.executable, "-m", "relax_slurm.launch.cli", *tiny_overrides(tiny_assets, run_dir),
           "cluster=slurm", "cluster.wait=true", "cluster.wait_poll_s=2",
           f"cluster.job_name={name}", "cluster.time_limit_min=60"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=FULL_RUN_TIMEOUT_S)
    finally:
        slurm(env, "scancel", f"--name={name}")  # a no-op once the job has ended
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_id = proc.stdout.split("submitted job ")[1].split()[0]
    assert f"run directory: {run_dir}" in proc.stdout and f"job {job_id}: completed" in proc.stdout
    assert (run_dir / "job.sbatch").read_text().count("#SBATCH hetjob") == 1
    assert "run finished" in (run_dir / f"slurm-{job_id}.out").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    check_het_run(run_dir, summary, env, job_id, steps=300)


@pytest.mark.timeout(FULL_RUN_TIMEOUT_S + 120)
def test_submitit_job_learns(tmp_path, tiny_assets, slurm_env, monkeypatch):
    import relax_slurm

    run_dir = tmp_path / "run"
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.chdir(REPO)
    job = relax_slurm.submit([*tiny_overrides(tiny_assets, run_dir), "cluster.time_limit_min=60",
                              f"cluster.job_name=relax-test-{uuid.uuid4().hex[:8]}"])
    try:
        wait_until(lambda: job.done(force_check=True), FULL_RUN_TIMEOUT_S, "the submitit job",
                   poll_s=5)
        summary = job.result()
    finally:
        if not job.done():
            job.cancel(check=False)
    # a het job's state, read from sacct's "<id>+0" row (submitit alone: UNKNOWN forever)
    wait_until(lambda: job.get_info(mode="force").get("State") == "COMPLETED", 120,
               "sacct to report the job COMPLETED", poll_s=2)
    assert "broker: srun --het-group=0" in (job.stdout() or "")  # the driver's log
    check_het_run(run_dir, summary, slurm_env, job.job_id, steps=300)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 300


def _has_gpus(env: dict) -> bool:
    return "gpu:" in slurm(env, "sinfo", "-h", "-o", "%G").stdout


@pytest.mark.timeout(2700)
def test_preempted_run_requeues_and_resumes(tmp_path, tiny_assets, slurm_env):
    """USR1 mid-run (as Slurm sends it before the time limit): the trainer checkpoints, the job
    requeues itself, and the next attempt resumes at the checkpointed step and finishes."""
    run_dir, env = tmp_path / "run", job_env(slurm_env)
    # the ready script asks for 8 GPUs per node; tools/slurm's nodes advertise fake ones
    extra = [] if _has_gpus(env) else ["--gpus-per-node=0"]
    overrides = [*tiny_overrides(tiny_assets, run_dir), f"trainer.total_steps={PREEMPT_STEPS}",
                 # a busy machine may need minutes to checkpoint: never force the requeue here
                 "cluster.signal_lead_s=1800", "cluster.preempt_timeout_s=1200",
                 "cluster.time_limit_min=60"]
    script = REPO / "sbatch" / "train_hetjob.sbatch"
    r = subprocess.run(["sbatch", "--parsable", *extra, str(script), *overrides], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    try:
        wait_until(lambda: len(read_rows(run_dir)) >= 3 or not in_queue(env, job_id), 900,
                   "3 training steps")
        assert slurm(env, "scancel", "--batch", "--signal=USR1", job_id).returncode == 0
        wait_until(lambda: (read_status(run_dir) or {}).get("state") in ("requeued", "failed"),
                   900, "the driver to requeue the job", poll_s=0.5)
        first = read_rows(run_dir)  # attempt 0 is over: what it trained
        ckpt = find_latest(run_dir)
        assert read_status(run_dir)["state"] == "requeued", read_status(run_dir)
        k = parse_step(ckpt)
        assert 3 <= k < PREEMPT_STEPS and [row["step"] for row in first] == list(range(k))
        wait_until(lambda: not in_queue(env, job_id), 900, "the requeued attempt to finish",
                   poll_s=2)
    finally:
        slurm(env, "scancel", job_id)
    status = read_status(run_dir)
    assert status["state"] == "completed" and status["attempt"] == 1, status
    rows = read_rows(run_dir)
    assert [row["step"] for row in rows] == list(range(PREEMPT_STEPS))  # none twice, none skipped
    assert rows[:k] == first  # attempt 0's steps were not trained again
    assert f"resumed from {ckpt} at step {k}" in (run_dir / "logs/trainer.log").read_text()
    broker_log = (run_dir / "logs/broker.log").read_text()
    assert f"restored from {ckpt}" in broker_log and f"'version': {k}" in broker_log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == PREEMPT_STEPS and summary["slurm"]["attempt"] == 1
    assert (tmp_path / f"slurm-relax-{job_id}.out").is_file()  # the script's --output, appended
    assert "got SIGUSR1" in (tmp_path / f"slurm-relax-{job_id}.out").read_text()
