"""The tiny experiment on a real slurmctld (tools/slurm/up.sh, see conftest.py): as a het job from
relax-train, as a submitit job, and preempted mid-run through a ready script (requeue, resume,
finish).

Runs are short (the tiny run needs ~90 s to start its processes and ~2-4 s per step on 2
cores) and train on one rank: 30 steps, where the preset's reward has risen from ~0 to ~0.3, for
the two learning runs; 40 for the preempted one. Each test bounds its time, cancels its job if it gives up, and
puts the run's logs into its failure message.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from relax_slurm.checkpoint import find_latest
from relax_slurm.checkpoint.resume import parse_step
from relax_slurm.launch.processes import log_tail
from relax_slurm.metrics.jsonl import iter_metrics
from relax_slurm.runtime.control import read_status
from tests.conftest import ONE_RANK, REPO, tiny_command
from tests.slurm.conftest import SETUP_ALLOWANCE_S

pytestmark = pytest.mark.slurm

LEARN_STEPS = 30
RUN_TIMEOUT_S = 900  # a 30-step run takes ~3 min here; more when the machine is busy
# a tiny step takes ~0.2-0.5 s now: the steps after SIGNAL_AFTER must outlast the mid-run
# stack dump (a new Python, `srun --overlap` on the node) and the USR1, or the run completes
# before it is preempted
PREEMPT_STEPS = 40
SIGNAL_AFTER = 5  # steps logged before the USR1
SAVE_EVERY = 5
RISE = 0.1  # reward_last - reward_first after LEARN_STEPS (~0.3 on this preset)
ROLE_GROUPS = {"broker": 0, "trainer": 0, "engine0": 1, "rollout": 1}
LOGS = ("broker", "engine0", "rollout", "trainer")


def tiny_overrides(tiny: Path, run_dir: Path, steps: int) -> list[str]:
    """The overrides of tests/conftest.py's tiny_command (without `python -m ...cli`)."""
    cmd = tiny_command(run_dir, tiny, f"trainer.total_steps={steps}", ONE_RANK,
                       "rollout.startup_timeout_s=600")  # a loaded 2-core machine: slow start
    assert cmd[1:3] == ["-m", "relax_slurm.launch.cli"], cmd
    return cmd[3:]


def slurm_command(tiny: Path, run_dir: Path, steps: int, name: str, *extra: str) -> list[str]:
    """`relax-train` of the tiny experiment as a het job called `name`, waiting for its end."""
    return [sys.executable, "-m", "relax_slurm.launch.cli", *tiny_overrides(tiny, run_dir, steps),
            *extra, "cluster=slurm", "cluster.wait=true", "cluster.wait_poll_s=2",
            f"cluster.job_name={name}", "cluster.time_limit_min=30"]


def job_env(slurm_env: dict[str, str]) -> dict[str, str]:
    return {**slurm_env, "PYTHONPATH": str(REPO), "RELAX_PYTHON": sys.executable}


def slurm(env: dict, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=60)


def wait_until(pred, timeout_s: float, what: str, poll_s: float = 1.0, why=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{why()}")
        time.sleep(poll_s)


def in_queue(env: dict, job_id: str) -> bool:
    return bool(slurm(env, "squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip())


def step_components(env: dict, job_id: str) -> dict[str, set[int]]:
    """Job step name -> the het components it ran in, as sacct recorded them."""
    r = slurm(env, "sacct", "-j", job_id, "-n", "-P", "-o", "JobID,JobName")
    assert r.returncode == 0, r.stderr
    out: dict[str, set[int]] = {}
    for line in r.stdout.splitlines():
        jid, _, name = line.partition("|")
        if "+" in jid and "." in jid:  # a step of a component: <job>+<k>.<step>
            out.setdefault(name, set()).add(int(jid.split("+")[1].split(".")[0]))
    return out


def read_rows(run_dir: Path) -> list[dict]:
    # the rows written so far: a line being written is not read yet (read while the run runs)
    return list(iter_metrics(run_dir / "metrics.jsonl"))


def diagnose(run_dir: Path, *extra: Path) -> str:
    """The tails of the driver's and the roles' logs, for failure messages, each with the
    error it logged above its tail (a trainer's tail is torchrun's summary: the rank's own
    error, a native crash's frame, is above it)."""
    parts = []
    for path in [*extra, *sorted(run_dir.glob("slurm-*.out")), run_dir / "slurm_status.json",
                 *(run_dir / "logs" / f"{n}.log" for n in LOGS)]:
        if path.is_file():
            parts.append(f"--- {path}\n" + log_tail(path, 15))
    return "\n".join(parts) or f"(nothing in {run_dir})"


def check_het_run(run_dir: Path, summary: dict, env: dict, job_id: str, steps: int) -> None:
    """A finished run of the tiny experiment as one het job: it learned, every role ran in its
    component (by the driver's record and by Slurm's), and every log is there."""
    why = diagnose(run_dir)
    assert summary["steps"] == steps, why
    assert [r["step"] for r in read_rows(run_dir)] == list(range(steps)), why
    assert summary["reward_last"] > summary["reward_first"] + RISE, summary
    for log in LOGS:
        path = run_dir / "logs" / f"{log}.log"
        assert path.is_file() and path.stat().st_size > 0, (log, why)
    info = summary["slurm"]
    assert info["het"] and info["job_id"] == job_id and info["attempt"] == 0, info
    assert set(info["trainer_hosts"]).isdisjoint(info["rollout_hosts"]), info  # a node each
    for role, group in ROLE_GROUPS.items():
        assert info["roles"][role]["het_group"] == group, (role, info["roles"][role])
    assert json.loads((run_dir / "slurm.json").read_text()) == info
    assert read_status(run_dir)["state"] == "completed"
    # what Slurm itself recorded: one step per role, in the role's component (sacct may lag
    # the job's end by a moment)
    seen = wait_until(lambda: (s := step_components(env, job_id)).keys() >= ROLE_GROUPS.keys()
                      and s, 60, f"sacct to list the steps of job {job_id}", poll_s=2,
                      why=lambda: str(step_components(env, job_id)))
    for role, group in ROLE_GROUPS.items():
        assert seen[role] == {group}, (role, seen)


@pytest.mark.timeout(RUN_TIMEOUT_S + 120 + SETUP_ALLOWANCE_S)
def test_relax_train_hetjob_learns(tmp_path, tiny_assets, slurm_env):
    run_dir, name = tmp_path / "run", f"relax-test-{uuid.uuid4().hex[:8]}"
    env = job_env(slurm_env)
    cmd = slurm_command(tiny_assets, run_dir, LEARN_STEPS, name)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    finally:
        slurm(env, "scancel", f"--name={name}")  # a no-op once the job has ended
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:] + "\n" + diagnose(run_dir)
    job_id = proc.stdout.split("submitted job ")[1].split()[0]
    assert f"run directory: {run_dir}" in proc.stdout and f"job {job_id}: completed" in out
    script = (run_dir / "job.sbatch").read_text()
    assert script.count("#SBATCH hetjob") == 1 and f"--job-name={name}" in script
    driver_log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "run finished" in driver_log and "srun --het-group=1" in driver_log
    summary = json.loads((run_dir / "summary.json").read_text())
    check_het_run(run_dir, summary, env, job_id, steps=LEARN_STEPS)


@pytest.mark.timeout(RUN_TIMEOUT_S + 180 + SETUP_ALLOWANCE_S)
def test_submitit_job_learns(tmp_path, tiny_assets, slurm_env, monkeypatch):
    import relax_slurm

    run_dir = tmp_path / "run"
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.chdir(REPO)
    job = relax_slurm.submit([*tiny_overrides(tiny_assets, run_dir, LEARN_STEPS),
                              "cluster.time_limit_min=30",
                              f"cluster.job_name=relax-test-{uuid.uuid4().hex[:8]}"])
    try:
        wait_until(lambda: job.done(force_check=True), RUN_TIMEOUT_S, "the submitit job",
                   poll_s=5, why=lambda: diagnose(run_dir, Path(job.paths.stdout)))
        summary = job.result()
    finally:
        if not job.done():
            job.cancel(check=False)
    # a het job's state, read from sacct's "<id>+0" row (submitit alone: UNKNOWN forever)
    wait_until(lambda: job.get_info(mode="force").get("State") == "COMPLETED", 120,
               "sacct to report the job COMPLETED", poll_s=2,
               why=lambda: str(job.get_info(mode="force")))
    assert job.state == "COMPLETED"
    driver_log = job.stdout() or ""
    assert "broker: srun --het-group=0" in driver_log and "rollout: srun --het-group=1" in \
        driver_log, driver_log[-3000:]
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    check_het_run(run_dir, summary, slurm_env, job.job_id, steps=LEARN_STEPS)


@pytest.mark.timeout(1500 + SETUP_ALLOWANCE_S)
def test_preempted_run_requeues_and_resumes(tmp_path, tiny_assets, slurm_env):
    """USR1 mid-run (what Slurm sends `signal_lead_s` before the time limit): the trainer
    checkpoints after its current step, the driver requeues the job, and the next attempt (same
    job id) resumes at the checkpointed step and finishes: metrics.jsonl has every step exactly
    once, and the steps of the first attempt were not trained again. Before the signal,
    `relax-ctl dump` takes every role's stacks on its node (issue #35), disturbing nothing."""
    run_dir, env = tmp_path / "run", job_env(slurm_env)
    # the ready script asks for 8 GPUs per node; tools/slurm's nodes advertise fake ones
    # (without mknod, e.g. not root, they have none)
    gpus = "gpu:" in slurm(env, "sinfo", "-h", "-o", "%G").stdout
    overrides = [*tiny_overrides(tiny_assets, run_dir, PREEMPT_STEPS),
                 f"trainer.save_every={SAVE_EVERY}",
                 # the step in progress + a checkpoint take seconds; a forced requeue (without
                 # a fresh checkpoint) must not happen here. The limit: < the script's USR1@120
                 "cluster.preempt_timeout_s=110"]
    script = REPO / "sbatch" / "train_hetjob.sbatch"
    r = subprocess.run(["sbatch", "--parsable", *([] if gpus else ["--gpus-per-node=0"]),
                        str(script), *overrides], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    out = tmp_path / f"slurm-relax-{job_id}.out"  # the script's --output, in the submit dir
    why = lambda: diagnose(run_dir, out)  # noqa: E731
    try:
        wait_until(lambda: len(read_rows(run_dir)) >= SIGNAL_AFTER or not in_queue(env, job_id),
                   600, f"{SIGNAL_AFTER} training steps", poll_s=0.2, why=why)
        assert in_queue(env, job_id), why()
        # mid-run, every role's stacks through `srun --overlap` on its node (relax-ctl dump);
        # the run goes on undisturbed (its remaining steps are checked below)
        ctl = subprocess.run([sys.executable, "-m", "relax_slurm.launch.ctl", "dump",
                              str(run_dir), "--wait-s", "60"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=180)
        assert ctl.returncode == 0, ctl.stderr + why()
        dumped = json.loads(ctl.stdout)
        assert dumped["did_not_answer"] == [] and dumped["not_registered"] == [], dumped
        assert {"broker", "engine0", "rollout", "trainer-rank0"} <= set(dumped["answered"]), \
            dumped
        for name in dumped["answered"]:
            text = (Path(dumped["folder"]) / f"{name}.txt").read_text()
            assert "Main thread 0x" in text, (name, text[-2000:])
        r = slurm(env, "scancel", "--batch", "--signal=USR1", job_id)
        assert r.returncode == 0, r.stderr
        wait_until(lambda: (read_status(run_dir) or {}).get("state") not in (None, "running"),
                   300, "the driver to stop the first attempt", poll_s=0.5, why=why)
        status = read_status(run_dir)
        assert status["state"] == "requeued" and status["attempt"] == 0, (status, why())
        first = read_rows(run_dir)  # what attempt 0 trained (its roles are stopped)
        ckpt = find_latest(run_dir)
        k = parse_step(ckpt)
        assert SIGNAL_AFTER <= k < PREEMPT_STEPS, (k, why())
        assert [row["step"] for row in first] == list(range(k)), why()
        # the requeued attempt: same job id, SLURM_RESTART_COUNT=1 (restarts ~11 s later
        # on this cluster while conftest.py nudges its scheduler; see tools/slurm/slurm.conf.in)
        wait_until(lambda: not in_queue(env, job_id), 900, "the requeued attempt to finish",
                   poll_s=2, why=why)
    finally:
        slurm(env, "scancel", job_id)  # a no-op once the job has ended
    status = read_status(run_dir)
    assert status["state"] == "completed" and status["attempt"] == 1, (status, why())
    rows = read_rows(run_dir)
    assert [row["step"] for row in rows] == list(range(PREEMPT_STEPS)), why()  # once each
    assert rows[:k] == first  # attempt 0's rows kept as they were: not trained again
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"preempted: checkpoint step_{k} saved" in trainer_log
    assert f"resumed from {ckpt} at step {k}" in trainer_log
    broker_log = (run_dir / "logs" / "broker.log").read_text()
    assert f"restored from {ckpt}" in broker_log and f"'version': {k}" in broker_log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == PREEMPT_STEPS and summary["slurm"]["attempt"] == 1, summary
    assert summary["slurm"]["job_id"] == job_id
    driver_log = out.read_text()  # both attempts, appended (--open-mode=append)
    assert "got SIGUSR1" in driver_log and "requeueing job" in driver_log
    assert "terminated" not in driver_log  # the requeue's own SIGTERM is not a termination
    assert f"job {job_id} attempt 1" in driver_log and "resumes from" in driver_log
    assert "run finished" in driver_log
    assert find_latest(run_dir).name == f"step_{PREEMPT_STEPS}"
