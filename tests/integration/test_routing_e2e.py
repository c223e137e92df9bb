"""Rollout routing replay (R3) end to end: `relax-train experiment=tiny_moe_cpu` (a tiny
Qwen3-MoE) through the real topology, its engine reporting the routed experts, the samples
carrying them through the broker, the trainer replaying them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from relax_slurm.tiny.model import main as make_tiny_model
from tests.conftest import (NEEDS_MEGATRON, ONE_RANK, REPO, relax_train, run_env,
                            stopped_on_reward, tiny_command, until_reward)

TIMEOUT_S = 900
MOE = ("algo.routing_replay=true",)
# SGLang's routers and the trainer's, both float32, choose other top-k sets only at a near-tie
# of router logits (test_sglang_moe.py: within ~1e-6): none in three measured 50-step runs; a
# step compares ~6k token x layer pairs, so this is at most ~3 near-ties in a step
MISMATCH_MAX = 5e-4
# the learning runs end once the 3-step mean reward reaches this, within 50 steps
# (tests/conftest.py until_reward): about half of the 0.46-0.53 their 50 steps reached
LEARNED = 0.25


@pytest.fixture(scope="module")
def moe_assets(tiny_assets) -> Path:
    """The session's tiny data with the tiny MoE next to its dense model: DIR/model is the MoE."""
    out = tiny_assets.parent / "tiny_moe"
    if not (out / "model" / "config.json").exists():
        assert make_tiny_model(["--out", str(out / "model"), "--kind", "moe"]) == 0
        (out / "arith_train.jsonl").symlink_to(tiny_assets / "arith_train.jsonl")
    return out


def run(run_dir: Path, assets: Path, *overrides: str) -> list[dict]:
    proc = relax_train(run_dir, assets, ONE_RANK, *overrides, timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.sglang_cpu
@pytest.mark.timeout(TIMEOUT_S + 300)  # + the venv's build on a fresh machine
def test_tiny_moe_learns_with_routing_replay_on_real_sglang(tmp_path, moe_assets,
                                                            sglang_cpu_python):
    """The routing the trainer replays is SGLang's own (--enable-return-routed-experts, which
    the launcher adds for algo.routing_replay), read from every /generate. The mean reward of
    the last steps is 0.46 at step 50 (measured three times; 0.53 on the hf engine, which
    reaches 0.77 in 150 steps): the run ends at about half of that (LEARNED)."""
    run_dir = tmp_path / "run"
    rows = run(run_dir, moe_assets, *MOE, "rollout=sglang", "trainer.total_steps=50",
               *until_reward(LEARNED))
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_on_reward(summary, [r["rollout/reward_mean"] for r in rows])
    assert summary["reward_first"] <= 0.3 and summary["reward_last"] >= LEARNED, summary
    engine_log = (run_dir / "logs" / "engine0.log").read_text()
    assert "'enable_return_routed_experts': True" in engine_log  # SGLang's own server_args
    # every step's samples carried the engine's routing (the metric exists only then), and the
    # trainer's own router chose the same experts (MISMATCH_MAX); every push arrived whole:
    # SGLang's log-probs are the trainer's on the pushed weights (float32 rounding apart;
    # measured 1.6e-7)
    assert max(r["train/routing_mismatch_frac"] for r in rows) <= MISMATCH_MAX, rows
    assert max(r["train/rollout_train_logprob_diff"] for r in rows) < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S + 100)
def test_routing_replay_resumes_exactly(tmp_path, moe_assets):
    """bfloat16 on both sides; 6 steps straight == the straight run's step-3 checkpoint + 3
    steps: the resumed engine reports the same routing and the trainer replays it the same."""
    common = (*MOE, "model.dtype=bfloat16", "trainer.save_every=3", "trainer.total_steps=6",
              "algo.max_staleness=0")
    straight = run(tmp_path / "straight", moe_assets, *common)
    resumed = run(tmp_path / "resumed", moe_assets, *common,
                  f"resume={tmp_path / 'straight' / 'checkpoints' / 'step_3'}")
    assert [r["step"] for r in resumed] == [3, 4, 5]
    keys = ("rollout/reward_mean", "train/loss", "train/routing_mismatch_frac",
            "train/rollout_train_logprob_diff")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys]
                                                       for r in straight[3:]]


@pytest.mark.slow
@NEEDS_MEGATRON
@pytest.mark.timeout(TIMEOUT_S + 100)
@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_moe_learns_under_megatron(tmp_path, moe_assets, tp):
    """The same MoE through megatron-bridge, replaying with megatron-core's routers: its
    per-expert export loads into the hf engine's fused experts (every sync verified); 150 steps
    reach 0.87 without replay (0.47 by step 50). At TP=2 megatron-core trains the MoE with
    sequence parallelism: each TP rank's routers replay (and compare) their slice of the
    sequence, and the metric counts every rank's tokens."""
    proc = relax_train(tmp_path / "run", moe_assets, f"trainer.nproc_per_node={tp}",
                       f"trainer.tensor_parallel_size={tp}", *MOE, "trainer=megatron",
                       "trainer.total_steps=50", "weight_sync.verify=true",
                       *until_reward(LEARNED), timeout_s=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(rows) == stopped_on_reward(summary, [r["rollout/reward_mean"] for r in rows])
    assert all(r["train/routing_mismatch_frac"] == 0.0 for r in rows)  # float32 both sides
    assert summary["reward_first"] <= 0.3 and summary["reward_last"] >= LEARNED, summary
    assert "weights verified" in (tmp_path / "run" / "logs" / "trainer.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 100)
def test_multi_turn_episodes_replay_their_routing(tmp_path, moe_assets):
    """experiment=tiny_agent_cpu (env=arith_feedback, up to 3 turns) on the tiny MoE with
    replay: every turn's report covers the positions no earlier turn did, so each trained
    sample carries routing at every position (the episodes end on a model turn), and the
    trainer's routers agree with it (float32 on both sides)."""
    run_dir = tmp_path / "agent_moe"
    cmd = tiny_command(run_dir, moe_assets, *MOE, "trainer.total_steps=3",
                       "debug.dump_rollouts=true", "metrics.progress=false",
                       experiment="tiny_agent_cpu")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["train/routing_mismatch_frac"] == 0.0 for r in rows)
    assert any(r["rollout/turns_mean"] > 1 for r in rows)  # some episodes took several turns
    samples = [json.loads(x) for f in sorted((run_dir / "rollouts").glob("*.jsonl"))
               for x in f.read_text().splitlines()]
    assert samples and all(s["routed_positions"] == s["prompt_len"] + s["response_len"] - 1
                           for s in samples)
