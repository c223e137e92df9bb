"""Exact resume through the real process topology: 6 steps straight == resume from the
straight run's step-3 checkpoint + 3 steps (the resumed run sees exactly what a run stopped at
step 3 would: its checkpoint holds the data position, RNG, broker counters and version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from relax_slurm.checkpoint.from_dcp import dcp_to_hf
from tests.conftest import REPO, relax_train

TIMEOUT_S = 600


def train(run_dir: Path, tiny: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = relax_train(run_dir, tiny, "algo.max_staleness=0", *overrides, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def rewards(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["rollout/reward_mean"]) for r in rows]


def final_weights(run_dir: Path, tmp: Path) -> dict:
    out = dcp_to_hf(run_dir / "checkpoints" / "step_6", tmp / f"hf_{run_dir.name}")
    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_resume_is_exact(tmp_path, tiny_assets):
    # two ranks (the preset's): each rank's RNG and data shard must come back
    # a higher lr makes the 6 steps move the weights and rewards visibly
    common = ("trainer.lr=2e-3", "trainer.save_every=3", "trainer.total_steps=6")
    straight = tmp_path / "straight"
    train(straight, tiny_assets, *common)
    step_3 = straight / "checkpoints" / "step_3"
    assert step_3.is_dir()
    resumed = tmp_path / "resumed"
    train(resumed, tiny_assets, *common, f"resume={step_3}")
    log = (resumed / "logs" / "trainer.log").read_text()
    assert "resumed from" in log and "at step 3" in log, log[-2000:]
    assert [s for s, _ in rewards(resumed)] == [3, 4, 5]  # no step twice, none skipped
    assert rewards(resumed) == rewards(straight)[3:]
    a, b = final_weights(straight, tmp_path), final_weights(resumed, tmp_path)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), name  # bitwise
    refuses_to_start_over(resumed, tiny_assets)


def refuses_to_start_over(run_dir: Path, tiny: Path) -> None:
    """resume=none on a run dir with checkpoints fails at once, pointing at overwrite=true
    (checked on this test's run dir: a run of its own cost ~60 s of start-up)."""
    cmd = [sys.executable, "-m", "relax_slurm.launch.cli", "experiment=tiny_cpu",
           f"run_dir={run_dir}", f"model.path={tiny / 'model'}",
           f"data.train_files=[{tiny / 'arith_train.jsonl'}]", "resume=none"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode != 0
    assert "overwrite=true" in proc.stderr


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ppo_resume_restores_the_sharded_critic_exactly(tmp_path, tiny_assets):
    """algo=ppo under FSDP2 on two ranks: the critic and its optimizer are sharded into the
    checkpoint with the policy; 4 steps straight == the step-2 checkpoint + 2 steps, the
    critic's loss, clip fraction and gradient norm included (two PPO mini-batches per batch,
    so the value clip bites)."""
    common = ("algo=ppo", "trainer.strategy=fsdp2", "trainer.num_steps_per_rollout=2",
              "trainer.save_every=2", "trainer.total_steps=4")
    straight = tmp_path / "straight"
    train(straight, tiny_assets, *common)
    resumed = tmp_path / "resumed"
    train(resumed, tiny_assets, *common, f"resume={straight / 'checkpoints' / 'step_2'}")
    keys = ("step", "rollout/reward_mean", "train/loss", "critic/vf_loss", "critic/vf_clipfrac",
            "critic/grad_norm", "critic/values_mean")
    got = [[r[k] for k in keys] for r in rows(resumed)]
    assert got == [[r[k] for k in keys] for r in rows(straight)[2:]]
    assert any(r["critic/vf_clipfrac"] > 0 for r in rows(straight))
