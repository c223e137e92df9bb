"""A global restart inside a Slurm allocation: a trainer rank SIGKILLed mid-run (what a crashed
rank or a GPU error does) stops every step of the het job; the driver starts every role again
as new srun steps from the latest checkpoint (cluster.restart.max_global=1), and the run
completes with every step logged once and no accepted sample lost. The same failure on a
drained node requeues the job onto other nodes instead."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from relax_slurm.runtime.control import read_status
from tests.slurm.conftest import SETUP_ALLOWANCE_S
from tests.slurm.test_slurm_elastic import running, steps_named
from tests.slurm.test_slurm_runs import (
    diagnose, job_env, read_rows, slurm, slurm_command, wait_until,
)

pytestmark = pytest.mark.slurm

STEPS = 30  # 0.2-0.5 s a step here: the kill lands long before the end
SAVE_EVERY = 2  # a checkpoint at step 2 or 4 before the kill: a restart redoes a step or two
KILL_AFTER = 4  # steps logged before the kill
RUN_TIMEOUT_S = 900


def trainer_rank_pid(run_dir: Path) -> int | None:
    """The trainer rank's own process (not torchrun's agent, not the driver's srun client,
    which carry the same arguments)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode().rstrip("\0").split("\0")
        except OSError:
            continue
        if (argv[-3:-1] == ["relax_slurm.trainer", "--run-dir"] and argv[-1] == str(run_dir)
                and "relax_slurm.runtime.torchrun" not in argv  # the agent
                and not argv[0].endswith("srun")):
            return int(proc.name)
    return None


@pytest.mark.timeout(RUN_TIMEOUT_S + 180 + SETUP_ALLOWANCE_S)
def test_a_killed_trainer_rank_restarts_every_role_as_new_srun_steps(tmp_path, tiny_assets,
                                                                   slurm_env):
    run_dir, name = tmp_path / "run", f"relax-test-{uuid.uuid4().hex[:8]}"
    env = job_env(slurm_env)
    cmd = slurm_command(tiny_assets, run_dir, STEPS, name, "metrics.progress=false",
                        f"trainer.save_every={SAVE_EVERY}", "cluster.restart.max_global=1")
    why = lambda: diagnose(run_dir)  # noqa: E731
    with running(cmd, env, name) as proc:
        wait_until(lambda: len(read_rows(run_dir)) >= KILL_AFTER or proc.poll() is not None,
                   600, f"{KILL_AFTER} training steps", poll_s=0.2, why=why)
        assert proc.poll() is None, why()
        pid = trainer_rank_pid(run_dir)
        assert pid is not None, why()
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:] + "\n" + why()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["global_restarts"] == 1, summary
    assert summary["samples_lost"] == 0, summary
    assert [r["step"] for r in read_rows(run_dir)] == list(range(STEPS))  # none twice or missing
    rows = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["attempt"]) for r in rows] == [("global", 1)], rows
    assert "trainer" in rows[0]["cause"], rows
    assert Path(rows[0]["resumes_from"]).name in {f"step_{k}" for k in range(2, STEPS, 2)}, rows
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
    job_id = summary["slurm"]["job_id"]
    assert summary["slurm"]["attempt"] == 0 and summary["slurm"]["global_restart"] == 1
    driver_log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "global restart 1 of 1" in driver_log, driver_log[-3000:]
    # every role again as a new step of the same job, in its component
    for role, group in (("trainer", 0), ("broker", 0), ("engine0", 1), ("rollout", 1)):
        steps = wait_until(lambda: s if len(s := steps_named(env, job_id, role)) >= 2 else None,
                           60, f"sacct to list both {role} steps",
                           why=lambda: str(steps_named(env, job_id, role)))
        assert len(steps) == 2 and all(s.startswith(f"{job_id}+{group}.") for s in steps), steps


@pytest.mark.timeout(RUN_TIMEOUT_S + 180 + SETUP_ALLOWANCE_S)
def test_a_failure_on_a_drained_node_requeues_the_job_onto_other_nodes(tmp_path, tiny_assets,
                                                                      slurm_env):
    """The same failure while a node of the job is drained (as a failed health check drains
    it): restarting there would fail again, so the driver requeues the job instead (although
    restart.max_global allows a restart); Slurm starts it on the other nodes, and it resumes."""
    run_dir, name = tmp_path / "run", f"relax-test-{uuid.uuid4().hex[:8]}"
    env = job_env(slurm_env)
    cmd = slurm_command(tiny_assets, run_dir, STEPS, name, "metrics.progress=false",
                        f"trainer.save_every={SAVE_EVERY}", "cluster.restart.max_global=1")
    why = lambda: diagnose(run_dir)  # noqa: E731
    node = None
    with running(cmd, env, name) as proc:
        try:
            wait_until(lambda: len(read_rows(run_dir)) >= KILL_AFTER or proc.poll() is not None,
                       600, f"{KILL_AFTER} training steps", poll_s=0.2, why=why)
            assert proc.poll() is None, why()
            node = json.loads((run_dir / "slurm.json").read_text())["rollout_hosts"][0]
            r = slurm(env, "scontrol", "update", f"nodename={node}", "state=drain",
                      "reason=relax-slurm test")
            assert r.returncode == 0, r.stderr
            pid = trainer_rank_pid(run_dir)
            assert pid is not None, why()
            os.kill(pid, signal.SIGKILL)
            # the drain holds until the requeued job has started elsewhere (~11 s here)
            wait_until(lambda: (read_status(run_dir) or {}).get("attempt") == 1
                       or proc.poll() is not None, 600, "the requeued attempt", why=why)
        finally:
            if node is not None:
                slurm(env, "scontrol", "update", f"nodename={node}", "state=resume")
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:] + "\n" + why()
    rows = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["requeue"], rows
    assert list(rows[0]["lost_nodes"]) == [node] and "DRAIN" in rows[0]["lost_nodes"][node]
    summary = json.loads((run_dir / "summary.json").read_text())
    info = summary["slurm"]
    assert info["attempt"] == 1 and info["global_restart"] == 0, info  # requeued, not restarted
    assert node not in info["trainer_hosts"] + info["rollout_hosts"], info
    assert summary["steps"] == STEPS and summary["samples_lost"] == 0, summary
    assert [r["step"] for r in read_rows(run_dir)] == list(range(STEPS))  # none twice or missing
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
    driver_log = (run_dir / f"slurm-{info['job_id']}.out").read_text()
    assert f"{node} (" in driver_log and "requeueing job" in driver_log, driver_log[-3000:]
