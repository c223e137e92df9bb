"""Elastic rollout on a real slurmctld, one run of the tiny experiment (one trainer rank) as a
het job from relax-train: `relax-ctl scale-out --num-replicas 2` mid-run submits the new engine
as its own Slurm job (launch/engine_job.py), which serves the trainer's current weights and
generates for the run; its engine SIGKILLed inside the job is restarted there (on record in
restarts.jsonl); its job ended by hand (as a time limit or a node failure would) is
reported lost and replaced by a new engine job; `relax-ctl scale-in --num-replicas 1` drains
that one and cancels its job; a scale-out cancelled after its job was submitted cancels that
job. Then `relax-ctl stop` ends the run (its length is no guess at when the last operation
ends): finished, completed for the driver, with samples_lost 0 and no engine job left in the
queue. Then, in a second short run, an engine
and then the rollout worker SIGKILLed mid-run are restarted in place as new srun steps of their
het component.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from relax_slurm.launch.ctl import admin_get
from relax_slurm.runtime.control import read_status
from tests.conftest import REPO
from tests.slurm.conftest import SETUP_ALLOWANCE_S
from tests.slurm.test_slurm_runs import (
    diagnose, in_queue, job_env, read_rows, slurm, slurm_command, wait_until,
)

pytestmark = pytest.mark.slurm

# more steps than the operations take (the last, the cancel, ended at step 77-102 at loads
# 2-15 on 2 cores); the run is stopped with `relax-ctl stop` once they are done
STEPS = 2000
RUN_TIMEOUT_S = 900
OP_TIMEOUT_S = 300


def ctl(env: dict, run_dir: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "relax_slurm.launch.ctl", *args[:1], str(run_dir),
                        *args[1:]], env=env, capture_output=True, text=True,
                       timeout=OP_TIMEOUT_S + 60)
    assert r.returncode == 0, r.stdout + r.stderr + "\n" + diagnose(run_dir)
    return json.loads(r.stdout)


def requests_on(run_dir: Path, url: str) -> int:
    """The rollout worker's requests to the engine at `url` so far, from the broker's admin
    GET /status (what `relax-ctl status` prints), read in this process: a poll that starts no
    Python of its own."""
    return admin_get(run_dir, "/status", 10)["roles"]["rollout"].get(
        "requests_per_engine", {}).get(url, 0)


def engine_jobs(env: dict, run_job_name: str) -> list[str]:
    """Ids of the engine jobs of the run named `run_job_name` still in the queue."""
    r = slurm(env, "squeue", "-h", "-o", "%i %j")
    return [i for i, _, n in (l.partition(" ") for l in r.stdout.splitlines())
            if n.startswith(f"{run_job_name}-engine")]


@contextmanager
def running(cmd: list[str], env: dict, name: str) -> Iterator[subprocess.Popen]:
    """`cmd` (relax-train) in its own session; on the way out, whatever is left of it and of
    the Slurm jobs called `name` (the run's) or `name-engine*` (its engine jobs) goes."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        slurm(env, "scancel", f"--name={name}")
        for job in engine_jobs(env, name):
            slurm(env, "scancel", job)


def job_state(env: dict, job_id: str) -> str:
    r = slurm(env, "sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State")
    return r.stdout.strip().split()[0] if r.stdout.strip() else ""


@pytest.mark.timeout(RUN_TIMEOUT_S + 180 + SETUP_ALLOWANCE_S)
def test_scale_out_submits_an_engine_job_then_drains_and_cancels_it(tmp_path, tiny_assets,
                                                                     slurm_env):
    run_dir, name = tmp_path / "run", f"relax-test-{uuid.uuid4().hex[:8]}"
    env = job_env(slurm_env)
    cmd = slurm_command(tiny_assets, run_dir, STEPS, name, "metrics.progress=false",
                        "rollout.groups_per_request=8",  # several requests a step: both engines
                        "cluster.restart.heartbeat_interval_s=1", "cluster.elastic.drain_timeout_s=120",
                        "cluster.elastic.job_cpus=2", "cluster.elastic.job_time_min=20")
    why = lambda: diagnose(run_dir)  # noqa: E731
    with running(cmd, env, name) as proc:
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
        version = int(httpx.get(new + "/model_info", timeout=10, headers={
            "Authorization": f"Bearer {secret}"}).json()["weight_version"])
        assert version >= max(version_at_request, 1)
        # and generates for the run
        wait_until(lambda: requests_on(run_dir, new) >= 2 or proc.poll() is not None,
                   OP_TIMEOUT_S, "requests on the new engine", poll_s=0.5, why=why)
        assert proc.poll() is None, why()
        roles = {r["name"]: r for r in json.loads((run_dir / "roles.json").read_text())}
        assert roles["engine1"]["kind"] == "slurm_job" and roles["engine1"]["url"] == new
        # its engine killed inside the job: restarted there, the driver records it
        os.kill(info["pid"], signal.SIGKILL)
        restarts = run_dir / "restarts.jsonl"
        wait_until(lambda: restarts.exists() and '"in_job"' in restarts.read_text(),
                   OP_TIMEOUT_S, "the in-job restart on record", why=why)
        # its job ends while it serves: the engine is lost, a new engine job replaces it
        lost_job = job_id
        slurm(env, "scancel", lost_job)
        driver_log = next(run_dir.glob("slurm-*.out"))
        wait_until(lambda: f"its Slurm job {lost_job} ended while it served; a new engine job "
                   "replaces it" in driver_log.read_text(), OP_TIMEOUT_S, "the loss", why=why)

        def replaced() -> list[str] | None:
            routable = admin_get(run_dir, "/rollout/engines", 10)["routable"]
            return routable if len(routable) == 2 and new not in routable else None
        new = next(u for u in wait_until(replaced, OP_TIMEOUT_S, "a replacement engine",
                                         poll_s=0.5, why=why) if u != first)
        roles = {r["name"]: r for r in json.loads((run_dir / "roles.json").read_text())}
        assert "engine1" not in roles and roles["engine2"]["url"] == new, roles
        job_id = roles["engine2"]["job_id"]
        assert job_id != lost_job and in_queue(env, job_id)
        wait_until(lambda: requests_on(run_dir, new) >= 2 or proc.poll() is not None,
                   OP_TIMEOUT_S, "requests on the replacement", poll_s=0.5, why=why)
        assert proc.poll() is None, why()
        # scale in to 1: drained, then its job cancelled
        op = ctl(env, run_dir, "scale-in", "--num-replicas", "1", "--wait")
        assert op["status"] == "COMPLETED" and "drain timeout" not in " ".join(op["history"]), op
        assert ctl(env, run_dir, "engines")["routable"] == [first]
        wait_until(lambda: not in_queue(env, job_id), 60, f"engine job {job_id} to end", why=why)
        assert not [r for r in json.loads((run_dir / "roles.json").read_text())
                    if r.get("kind") == "slurm_job"]
        # a scale-out cancelled once its job is submitted: rolled back, the job cancelled
        rid = ctl(env, run_dir, "scale-out", "--num-replicas", "2")["request_id"]
        wait_until(lambda: f"{rid}: submitted Slurm job" in driver_log.read_text(), 60,
                   f"{rid}'s engine job", why=why)
        assert ctl(env, run_dir, "cancel", rid)["status"] == "CANCELLED"
        wait_until(lambda: not engine_jobs(env, name), 60, "the engine job to be cancelled",
                   why=why)
        assert ctl(env, run_dir, "stop", "--reason", "operations done")["requested"] == "stop"
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:] + "\n" + why()
    state = wait_until(lambda: job_state(env, job_id) or None, 60, "sacct's row of the job")
    assert state.startswith(("CANCELLED", "COMPLETED")), state
    summary = json.loads((run_dir / "summary.json").read_text())
    reached = summary["steps"]
    assert summary["stopped_early"] == {"at_step": reached, "total_steps": STEPS,
                                        "reason": "operations done"}, summary
    assert 2 < reached < STEPS and summary["samples_lost"] == 0, summary
    assert read_status(run_dir)["state"] == "completed"  # a finished run: no requeue
    assert summary["restarts"] == {"engine1": 2}, summary  # restarted in its job, replaced
    rows = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["role"], r["kind"]) for r in rows] == [("engine1", "in_job"),
                                                      ("engine1", "replaced")], rows
    log = driver_log.read_text()
    assert f"cancelled the Slurm job {job_id} of engine2" in log, log[-3000:]
    # the cancel lands while the job is queued (PENDING) or, if it started first, once it has
    # reported its URL (a rollback): the job is cancelled either way
    second = log.split(f"{rid}: submitted Slurm job(s) ['", 1)[1].split("'", 1)[0]
    assert (f"{rid}: ended before its engines reported; their jobs are cancelled" in log
            or f"cancelled the Slurm job {second} of " in log), log[-3000:]
    assert "weight-sync cohort: engines" in (run_dir / "logs" / "trainer.log").read_text()


# the steps after KILL_AFTER must outlast finding and killing both roles (~0.2-0.5 s a step)
RESTART_STEPS = 20
KILL_AFTER = 2  # steps logged before the kill


def role_pid(pattern: str) -> int | None:
    """The role's process itself (under slurmstepd, not the driver's srun client), by a
    regular expression on its command line."""
    r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, timeout=30)
    pids = []
    for pid in r.stdout.split():
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if not argv0.endswith(b"srun"):  # the driver's srun client has the same command line
            pids.append(int(pid))
    return pids[0] if len(pids) == 1 else None


def steps_named(env: dict, job_id: str, name: str) -> list[str]:
    """sacct's ids of the steps called `name` (`<job>+<component>.<step>`)."""
    r = slurm(env, "sacct", "-j", job_id, "-n", "-P", "-o", "JobID,JobName")
    return [line.split("|")[0] for line in r.stdout.splitlines() if line.endswith(f"|{name}")]


@pytest.mark.timeout(RUN_TIMEOUT_S + 180 + SETUP_ALLOWANCE_S)
def test_killed_engine_and_worker_restart_as_new_srun_steps(tmp_path, tiny_assets, slurm_env):
    run_dir, name = tmp_path / "run", f"relax-test-{uuid.uuid4().hex[:8]}"
    env = job_env(slurm_env)
    cmd = slurm_command(tiny_assets, run_dir, RESTART_STEPS, name, "metrics.progress=false")
    why = lambda: diagnose(run_dir)  # noqa: E731
    with running(cmd, env, name) as proc:
        wait_until(lambda: len(read_rows(run_dir)) >= KILL_AFTER or proc.poll() is not None,
                   600, f"{KILL_AFTER} training steps", poll_s=0.2, why=why)
        assert proc.poll() is None, why()
        [url] = json.loads((run_dir / "plan.json").read_text())["engine_urls"]
        pid = role_pid(f"relax_slurm.engines.hf .*--port {url.rsplit(':', 1)[1]} ")
        assert pid is not None, why()
        srun_pid = next(r["pid"] for r in json.loads((run_dir / "roles.json").read_text())
                        if r["name"] == "engine0")
        os.kill(pid, signal.SIGKILL)
        # then the rollout worker, while the engine comes back (the run cannot step meanwhile)
        restarts = run_dir / "restarts.jsonl"
        wait_until(lambda: restarts.exists() and "engine0" in restarts.read_text(), 120,
                   "the engine's restart", poll_s=0.2, why=why)
        pid = role_pid(f"relax_slurm.rollout --run-dir {run_dir}$")
        assert pid is not None, why()
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:] + "\n" + why()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == RESTART_STEPS, summary
    assert summary["restarts"] == {"engine0": 1, "rollout": 1}, summary
    assert summary["samples_lost"] == 0, summary
    roles = {r["name"]: r for r in json.loads((run_dir / "roles.json").read_text())}
    assert roles["engine0"]["restarts"] == 1 and roles["engine0"]["pid"] != srun_pid  # new srun
    job_id = summary["slurm"]["job_id"]
    # each restart is a new step of the same name in the rollout component
    for role in ("engine0", "rollout"):
        steps = wait_until(lambda: s if len(s := steps_named(env, job_id, role)) >= 2 else None,
                           60, f"sacct to list both {role} steps",
                           why=lambda: str(steps_named(env, job_id, role)))
        assert len(steps) == 2 and all(s.startswith(f"{job_id}+1.") for s in steps), steps
    driver_log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "engine0 exited with code" in driver_log and "restarted in place" in driver_log
    rows = [json.loads(l) for l in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["role"], r["kind"]) for r in rows] == [("engine0", "in_place"),
                                                      ("rollout", "in_place")], rows
