"""experiment=tiny_agent_cpu end to end: multi-turn episodes of env=arith_feedback through the
real topology (the worker drives the episodes, the trainer trains on the model's tokens only);
the reward rises and the model needs fewer tries."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, run_env, tiny_command

STEPS = 40  # one rank, lr 2e-3: reward 0.03 -> 0.40 and 2.96 -> 2.43 tries by step 40 (measured)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_agent_learns_to_answer_in_fewer_tries(tmp_path, tiny_assets):
    run_dir = tmp_path / "agent"
    cmd = tiny_command(run_dir, tiny_assets, f"trainer.total_steps={STEPS}",
                       "metrics.progress=false", experiment="tiny_agent_cpu")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=800,
                          env=run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["reward_last"] >= summary["reward_first"] + 0.15, summary
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    turns = [r["rollout/turns_mean"] for r in rows]
    assert all(1 <= t <= 3 for t in turns)  # env.max_turns=3
    assert sum(turns[-5:]) < sum(turns[:5])  # right answers come sooner
    assert all(0 <= r["rollout/episode_truncated_frac"] <= 1 for r in rows)
