"""Chaos on the real topology (relax-train, tiny experiment, one trainer rank):

- the broker, then the rollout worker, are SIGKILLed mid-run (one run): the launcher restarts
  each in place (the broker from its spill file, its clients resend; the worker rejoins with its
  predecessor's credits and data position), and the run completes with every accepted sample
  trained or dropped as stale (`samples_lost: 0`) and the restarts in summary.json,
  restarts.jsonl and roles.json; the run's secret guards the broker's admin HTTP and the engine
  on the way;
- the rollout worker is frozen (SIGSTOP): its heartbeat stops, the launcher names it hung and
  restarts the run from its checkpoint, which then completes;
- an engine is SIGKILLed: restarted in place, it re-joins the weight sync through a new cohort
  (its groups in flight are re-queued by the worker), and nothing is lost.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ONE_RANK, REPO, run_env, tiny_command

TIMEOUT_S = 900
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 60)]


def start(run_dir: Path, tiny: Path, *overrides: str) -> subprocess.Popen:
    cmd = tiny_command(run_dir, tiny, ONE_RANK, "metrics.progress=false", *overrides)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=run_env(), start_new_session=True)


def wait_steps(proc: subprocess.Popen, run_dir: Path, n: int) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    return out, err


def role(run_dir: Path, name: str) -> dict:
    return next(r for r in json.loads((run_dir / "roles.json").read_text()) if r["name"] == name)


def test_killed_broker_and_worker_restart_in_place_and_lose_nothing(tmp_path, tiny_assets):
    run_dir, steps = tmp_path / "run", 10
    proc = start(run_dir, tiny_assets, f"trainer.total_steps={steps}", "algo.max_staleness=1")
    try:
        wait_steps(proc, run_dir, 2)
        secret = (run_dir / "secret").read_text().strip()
        assert stat.S_IMODE((run_dir / "secret").stat().st_mode) == 0o600
        assert secret not in (run_dir / "config.yaml").read_text()
        plan = json.loads((run_dir / "plan.json").read_text())
        engine = plan["engine_urls"][0]
        assert httpx.post(engine + "/generate", json={"input_ids": [4]}).status_code == 401
        status = httpx.get(plan["broker_admin"] + "/status",
                           headers={"Authorization": f"Bearer {secret}"}, timeout=10).json()
        assert status["version"] >= 2 and "trainer" in status["roles"]
        assert "rollout" in status["roles"]
        assert httpx.get(plan["broker_admin"] + "/status").status_code == 401
        broker = role(run_dir, "broker")
        os.kill(broker["pid"], signal.SIGKILL)
        wait_steps(proc, run_dir, 5)
        worker = role(run_dir, "rollout")
        os.kill(worker["pid"], signal.SIGKILL)
        _, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "broker exited with code -9; restarted in place" in err
    assert "rollout exited with code -9; restarted in place" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["samples_lost"] == 0, summary
    assert summary["restarts"] == {"broker": 1, "rollout": 1}
    assert role(run_dir, "broker")["pid"] != broker["pid"]
    assert role(run_dir, "rollout")["pid"] != worker["pid"]
    rows = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["role"], r["kind"]) for r in rows] == [("broker", "in_place"),
                                                      ("rollout", "in_place")]
    assert "replayed" in (run_dir / "logs" / "broker.log").read_text()
    assert "rejoined" in (run_dir / "logs" / "rollout.log").read_text()
    steps_logged = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text()
                    .splitlines()]
    assert steps_logged == list(range(steps))


def test_a_frozen_worker_is_named_hung_and_the_run_restarts(tmp_path, tiny_assets):
    run_dir, steps = tmp_path / "run", 6
    proc = start(run_dir, tiny_assets, f"trainer.total_steps={steps}", "trainer.save_every=2",
                 "cluster.max_global_restarts=1", "cluster.heartbeat_interval_s=2",
                 "cluster.heartbeat_timeout_s=20")
    try:
        wait_steps(proc, run_dir, 3)  # step_2 is saved before step index 2 is logged
        worker = role(run_dir, "rollout")
        os.kill(worker["pid"], signal.SIGSTOP)
        _, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "global restart 1 of 1" in err
    rows = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["kind"] == "global"
    assert "role 'rollout' sent no heartbeat" in rows[0]["cause"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["global_restarts"] == 1


def test_a_killed_engine_restarts_in_place_and_rejoins_the_weight_sync(tmp_path, tiny_assets):
    run_dir, steps = tmp_path / "run", 8
    proc = start(run_dir, tiny_assets, f"trainer.total_steps={steps}",
                 "weight_sync.verify=true")  # every push checked bit for bit, the new cohort's too
    try:
        wait_steps(proc, run_dir, 3)
        engine = role(run_dir, "engine0")
        os.kill(engine["pid"], signal.SIGKILL)
        _, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "engine0 exited with code -9; restarted in place" in err
    assert "global restart" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["samples_lost"] == 0, summary
    assert summary["restarts"].get("engine0") == 1, summary
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "weight-sync cohort 1 formed" in trainer_log
