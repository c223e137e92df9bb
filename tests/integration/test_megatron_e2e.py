"""`trainer=megatron` end to end on the tiny experiment (the real topology: broker, hf engine,
rollout worker, torchrun trainer running megatron-core through megatron-bridge on CPU/gloo).

Each run checks, with weight_sync.verify=true, that after every sync the engine's weights equal
the HF weights the bridge exported (gathered across TP), and that the reward rises. The TP=2
run saves asynchronously (trainer.async_save=true) and sends one broadcast per tensor (the
preset's flattened buckets are what the TP=1 run sends), converts its final Megatron dist-checkpoint
with relax-convert and compares it with the HF export the trainer wrote at the same step, and
resumes from its step-27 checkpoint (exact: same rewards, same final weights). That run also
has a KL loss whose reference becomes the policy every 3rd batch (algo.ref_update_interval):
its KL is ~0 right after each refresh, and the resume needs the reference the checkpoint kept.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import NEEDS_MEGATRON, ONE_RANK, REPO, relax_train, run_env

STEPS = 30  # reward ~0.002 -> ~0.15-0.2 by step 25 (TP=1, TP=2): 30 keeps a ~2x margin over RISE
RISE = 0.1
# The TP=1 run is async (algo.max_staleness=1) with weight_sync.overlap=false: the inline,
# streamed push a gathered export falls back to when its whole copy would not fit in host
# memory (trainer/overlap.py), pausing the engine around it. Its samples are a version
# behind: rises of 0.154 / 0.161 / 0.148 in 30 steps at seeds 0, 1, 2; half the slowest
ASYNC_RISE = 0.074
REF_EVERY = 3  # the TP=2 run's algo.ref_update_interval: the step-27 checkpoint follows a refresh

pytestmark = [
    pytest.mark.slow,
    NEEDS_MEGATRON,
]


@pytest.mark.timeout(1300)
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_trainer_learns_with_verified_sync(tmp_path, tiny_assets, tp):
    run_dir = tmp_path / f"tp{tp}"
    common = ("trainer=megatron", f"trainer.nproc_per_node={tp}",
              f"trainer.tensor_parallel_size={tp}", "weight_sync.verify=true",
              f"trainer.total_steps={STEPS}", "metrics.progress=false")
    if tp == 1:
        common += ("algo.max_staleness=1", "weight_sync.overlap=false")
    if tp == 2:  # a checkpoint 3 steps before the end (resumed below) and the final HF export,
        # both checkpoints written asynchronously (megatron-core's forked writer); one
        # broadcast per tensor (the preset flattens buckets: both are verified); a KL loss
        # whose reference becomes the policy every 3rd batch (small: no learning claim rests
        # on it), so the resume also needs the refreshed reference from the checkpoint
        common += (f"trainer.save_every={STEPS - 3}", f"trainer.save_hf_every={STEPS}",
                   "trainer.async_save=true", "weight_sync.load_format=null",
                   "algo.kl_loss_coef=0.01", "algo.kl_loss_type=k3",
                   f"algo.ref_update_interval={REF_EVERY}")
    proc = relax_train(run_dir, tiny_assets, *common, timeout_s=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert log.count("weights verified bit for bit") == STEPS + 1  # the start and every step
    sends = re.findall(r"in (\d+) buckets \((\d+) broadcasts\)", log)
    assert len(sends) == STEPS + 1
    # flattened: a broadcast per bucket; else one per tensor (the tiny model has 24)
    assert all((n == b) == (tp == 1) for b, n in sends), sends[:3]
    assert summary["reward_last"] >= summary["reward_first"] + (RISE if tp == 2 else ASYNC_RISE), \
        summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/update_skipped"] == 0 for r in rows)
    if tp == 1:  # ran a version ahead (a step on a loaded machine may find the worker not
        # ahead: staleness 0); every push inline: the loop waited for all of it
        stale = [r["broker/staleness_max"] for r in rows]
        assert set(stale) == {0, 1} or set(stale) == {1}, stale
        assert all(r["perf/weight_sync_s"] == r["perf/weight_sync_push_s"] for r in rows)
        return
    # the batch right after a refresh measures the KL against the policy's own weights, which
    # the sharded reference (megatron/reference.py) runs through the same kernels at the same
    # layout: exactly 0; the others are a batch or more away from it
    kl = [r["train/kl_loss"] for r in rows]
    fresh = [i for i in range(STEPS) if i % REF_EVERY == 0]
    assert all(kl[i] == 0.0 for i in fresh), kl
    assert all(kl[i] > 1e-4 for i in range(STEPS) if i not in fresh), kl
    assert log.count("reference model refreshed") == STEPS // REF_EVERY
    ckpt = run_dir / "checkpoints" / f"step_{STEPS}"
    assert json.loads((ckpt / "meta.json").read_text())["backend"] == "megatron"
    out = tmp_path / "converted"
    conv = subprocess.run([sys.executable, "-m", "relax_slurm.checkpoint.cli", "--input",
                           str(run_dir), "--output", str(out)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=600)
    assert conv.returncode == 0, conv.stdout[-3000:] + conv.stderr[-3000:]
    exported = load_file(str(run_dir / "hf" / f"step_{STEPS}" / "model.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(exported)
    for k in exported:
        assert torch.equal(converted[k], exported[k]), k

    # exact resume through the trainer loop: the last 3 steps again from the step-27 Megatron
    # checkpoint give the same rewards and the same final weights, bit for bit
    resumed = tmp_path / "resumed"
    proc = relax_train(resumed, tiny_assets, *common,
                       f"resume={run_dir / 'checkpoints' / f'step_{STEPS - 3}'}", timeout_s=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == list(range(STEPS - 3, STEPS))
    for key in ("rollout/reward_mean", "train/kl_loss"):  # the reference came back, too
        assert [r[key] for r in again] == [r[key] for r in rows[STEPS - 3:]], key
    final = load_file(str(resumed / "hf" / f"step_{STEPS}" / "model.safetensors"))
    for k in exported:
        assert torch.equal(final[k], exported[k]), k



# reward ~0 -> a 10-step mean >= 0.6 first over steps 32-41 to 42-51, 0.75-0.81 at best by
# step 70 (seeds 0-3, one rank; docs/algorithms.md#under-trainermegatron): ~20 steps' margin
PPO_STEPS = 70
PPO_RESUMED = 2  # the last steps again from the checkpoint before them


@pytest.mark.timeout(1500)
def test_megatron_ppo_learns_and_resumes_its_critic_exactly(tmp_path, tiny_assets):
    """`experiment=tiny_cpu algo=ppo trainer=megatron` as a user types it (one rank): the
    megatron critic (trainer/megatron/critic.py), GAE advantages and the preset's four PPO
    mini-batch steps per batch learn the tiny task, and the critic learns the returns; then the
    last PPO_RESUMED steps again from the run's own checkpoint before them repeat exactly:
    rewards, the policy's loss and every critic metric (the critic and its Adam state came back
    from the dist-checkpoint).

    The bounds hold over seeds, not one trajectory: another CPU's float32 sums change which
    tokens are sampled, which is a different seed's run. Measured over seeds 0-3 (70 steps):
    reward 0.00-0.02 at the first step, best 10-step mean 0.75-0.81 (first >= 0.6 over steps
    32-41 to 42-51); the critic's mean value over the last 10 steps 0.53-0.81 (0.00-0.03 over
    the first 10), within 0.05-0.10 of the mean return. Not asked: seed 0's 3-step peak of
    0.85 (0.77-0.81 for seeds 1-3), or a falling value loss (it rises with the returns' spread
    as the policy learns, and fell by half on seeds 0 and 2 only)."""
    common = ("trainer=megatron", ONE_RANK, "algo=ppo", "metrics.progress=false",
              f"trainer.total_steps={PPO_STEPS}",
              f"trainer.save_every={PPO_STEPS - PPO_RESUMED}")
    run_dir = tmp_path / "ppo"
    proc = relax_train(run_dir, tiny_assets, *common, timeout_s=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == PPO_STEPS and summary["reward_first"] <= 0.3, summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reward = [r["rollout/reward_mean"] for r in rows]
    best = max(sum(reward[i:i + 10]) / 10 for i in range(len(reward) - 9))
    assert best >= 0.6, reward
    values = [r["critic/values_mean"] for r in rows]
    gap = [abs(r["critic/values_mean"] - r["critic/returns_mean"]) for r in rows]
    # a critic that learned nothing stays near 0 while the returns rise to ~0.7
    assert sum(values[:10]) / 10 < 0.1 and sum(values[-10:]) / 10 >= 0.4, values
    assert sum(gap[-10:]) / 10 < 0.2, gap

    resumed = tmp_path / "resumed"
    ckpt = run_dir / "checkpoints" / f"step_{PPO_STEPS - PPO_RESUMED}"
    proc = relax_train(resumed, tiny_assets, *common, f"resume={ckpt}", timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == list(range(PPO_STEPS - PPO_RESUMED, PPO_STEPS))
    keys = ("rollout/reward_mean", "train/loss", "critic/vf_loss", "critic/vf_clipfrac",
            "critic/grad_norm", "critic/values_mean", "critic/returns_mean")
    assert ([[r[k] for k in keys] for r in again]
            == [[r[k] for k in keys] for r in rows[-PPO_RESUMED:]])
