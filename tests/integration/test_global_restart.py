"""A trainer rank killed mid-run: the launcher restarts every role from the latest checkpoint
(cluster.max_global_restarts) and the run completes with every step trained once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, run_env, tiny_command
from tests.integration.test_launcher_failures import alive

STEPS, SAVE_EVERY = 10, 3
TIMEOUT_S = 900


def trainer_ranks(torchrun_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
def test_killed_trainer_rank_restarts_the_run_from_its_checkpoint(tmp_path, tiny_assets):
    run_dir = tmp_path / "run"
    cmd = tiny_command(run_dir, tiny_assets, "metrics.progress=false",
                       f"trainer.total_steps={STEPS}", f"trainer.save_every={SAVE_EVERY}",
                       "cluster.max_global_restarts=1")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=run_env())
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + TIMEOUT_S
        # step_3 is committed before the metrics line of step 3 (index 2) is written
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= SAVE_EVERY + 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        first_roles = json.loads((run_dir / "roles.json").read_text())
        torchrun = next(r["pid"] for r in first_roles if r["name"] == "trainer")
        ranks = trainer_ranks(torchrun)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "global restart 1 of 1" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_restarts"] == 1 and summary["steps"] == STEPS
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(STEPS))  # redone steps replaced, none missing or twice
    restarts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1 and "trainer" in restarts[0]["cause"]
    assert restarts[0]["resumes_from"].endswith(("step_3", "step_6", "step_9"))
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()
    assert not [r["name"] for r in first_roles if alive(r["pid"])]  # the first attempt is gone
