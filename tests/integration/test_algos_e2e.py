"""The wired algorithms, end to end on the tiny experiment: cispo, gspo, sapo and dapo (dynamic
sampling) learn the task, and so does grpo with several optimizer steps per rollout batch; opd,
and gspo with a teacher, distill a second tiny model served by a teacher engine.

Each run is the real process topology (broker, engine(s), rollout worker, torchrun trainer) and
costs ~90 s of start-up plus ~3 s per step on an idle 2-core machine, so step counts are
the fewest that still show learning clearly (see RUNS), on one trainer rank (ONE_RANK).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import (NEEDS_MEGATRON, ONE_RANK, relax_train, run_tool, stopped_on_reward,
                            until_reward)

RUN_TIMEOUT_S = 900
TEACHER_SHARPNESS = 6.0
# per algorithm: steps and overrides beyond `algo=<name>` (lr: the tiny_cpu default unless noted)
RUNS = {
    "cispo": (40, []),  # as grpo at ratio 1 (one step per batch): 0.10 by step 25, 0.40 by 40
    "gspo": (25, []),
    "sapo": (25, []),
    "dapo": (25, []),
}
RISE = 0.1  # reward_last - reward_first: on one rank each gains 0.2-0.35 by step 25


def finished(run_dir: Path, proc: subprocess.CompletedProcess, steps: int | None
             ) -> tuple[dict, list[dict]]:
    """The run's summary and rows; `steps` None: a run ended on its reward target
    (tests/conftest.py until_reward), whatever step that was."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if steps is None:
        steps = stopped_on_reward(summary, [r["rollout/reward_mean"] for r in rows])
    assert summary["steps"] == steps
    for key in ("train/entropy", "train/tokens", "train/clipfrac", "rollout/reward_errors",
                "rollout/filtered_groups"):
        assert key in rows[-1], key
    assert sum(r["rollout/reward_errors"] for r in rows) == 0
    return summary, rows


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(RUNS))
def test_algorithm_learns_the_tiny_task(tmp_path, tiny_assets, algo):
    steps, overrides = RUNS[algo]
    run_dir = tmp_path / algo
    proc = relax_train(run_dir, tiny_assets, ONE_RANK, "metrics.progress=false", f"algo={algo}",
                       f"trainer.total_steps={steps}", *overrides)
    summary, rows = finished(run_dir, proc, steps)
    assert summary["reward_last"] >= summary["reward_first"] + RISE, summary
    if algo == "dapo":  # dynamic sampling: uniform groups were dropped and replaced
        assert sum(r["rollout/filtered_groups"] for r in rows) > 0
        assert all(r["train/samples"] == 32 * 16 for r in rows)  # the batch stays full


def make_teacher(tiny: Path, out: Path) -> Path:
    """A second tiny model (tools/make_tiny_model.py, another seed), made peaked.

    Two randomly initialised tiny models both predict almost uniformly (KL ~0.02 nats): nothing
    to distill. Scaling the teacher's final norm sharpens its logits (same preferences, ~0.8 nats
    from the student), which the student can then be seen to approach.
    """
    run_tool("make_tiny_model.py", "--out", str(out), "--seed", "1")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(TEACHER_SHARPNESS)
    model.save_pretrained(out)
    return out


@pytest.mark.slow
def test_opd_distills_a_teacher_engine(tmp_path, tiny_assets):
    steps = 20  # one rank: the reverse KL falls from ~1.5 to ~0.2 by step 12
    teacher = make_teacher(tiny_assets, tmp_path / "teacher")
    run_dir = tmp_path / "opd"
    proc = relax_train(run_dir, tiny_assets, ONE_RANK, "metrics.progress=false", "algo=opd",
                       f"algo.teacher_model_path={teacher}", f"trainer.total_steps={steps}")
    _, rows = finished(run_dir, proc, steps)
    roles = {r["name"] for r in json.loads((run_dir / "roles.json").read_text())}
    assert roles == {"broker", "engine0", "teacher", "rollout", "trainer"}
    kl = [r["train/opd_reverse_kl"] for r in rows]
    first, last = sum(kl[:10]) / 10, sum(kl[-10:]) / 10
    assert last < 0.5 * first, (first, last)


@pytest.mark.slow
def test_several_optimizer_steps_per_rollout_batch_learn(tmp_path, tiny_assets):
    """trainer.num_steps_per_rollout=4: each batch of 512 samples is four mini-batches, four
    optimizer steps, ratios against the policy before the first (clipfrac > 0 from the second
    on). One metrics row and one policy version per batch. The log-probs, old and new, over
    chunks of 8 positions (trainer.logprob_chunk_size: the same values, a tenth of the float32
    logits at a time)."""
    steps = 15
    run_dir = tmp_path / "minibatch"
    proc = relax_train(run_dir, tiny_assets, ONE_RANK, "metrics.progress=false", "algo=grpo",
                       "trainer.num_steps_per_rollout=4", f"trainer.total_steps={steps}",
                       "trainer.logprob_chunk_size=8")
    summary, rows = finished(run_dir, proc, steps)
    assert [r["policy/version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["train/tokens"] > 0 for r in rows)
    assert max(r["train/clipfrac"] for r in rows) > 0
    # measured: reward 0.004 -> 0.17 by step 15 (one step per batch: cispo, grpo's equal there, 0.10 by step 25), clipfrac
    # 0 on the first steps (near-uniform policy), 0.06-0.12 from step 10
    assert summary["reward_last"] >= summary["reward_first"] + 0.08, summary


@pytest.mark.slow
def test_opd_on_another_estimator_distills(tmp_path, tiny_assets):
    """The teacher term on GSPO's sequence-ratio loss (algo=gspo + algo.teacher_model_path):
    the student's reverse KL to the teacher falls as with algo=opd."""
    steps = 20
    teacher = make_teacher(tiny_assets, tmp_path / "teacher")
    run_dir = tmp_path / "gspo_opd"
    proc = relax_train(run_dir, tiny_assets, ONE_RANK, "metrics.progress=false", "algo=gspo",
                       f"algo.teacher_model_path={teacher}", f"trainer.total_steps={steps}")
    _, rows = finished(run_dir, proc, steps)
    kl = [r["train/opd_reverse_kl"] for r in rows]
    # measured on one rank: 1.50 at step 1, 0.32 at step 20 (GSPO's narrow sequence clip moves
    # slower than algo=opd's token clip); means of the first and last 5 steps 1.41 and 0.41
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert last < 0.5 * first, (first, last)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", pytest.param("megatron", marks=NEEDS_MEGATRON)])
def test_reward_side_kl_against_a_refreshed_reference(tmp_path, tiny_assets, backend):
    """algo.kl_coef alone loads the reference; algo.ref_update_interval=2 makes it the policy
    after steps 2 and 4: the KL measured on steps 3 and 5 (before their updates, against the
    weights just copied) is 0, the others' is not. No learning claim: a wiring run. Under
    megatron with algo=ppo: the critic's reward-side KL against the sharded reference
    (megatron/reference.py), whose log-probs the rows carry."""
    steps = 5
    run_dir = tmp_path / "reward_kl"
    algo = ["algo=grpo"] if backend == "torch" else ["trainer=megatron", "algo=ppo"]
    proc = relax_train(run_dir, tiny_assets, ONE_RANK, "metrics.progress=false", *algo,
                       "algo.kl_coef=0.05", "algo.kl_loss_type=k3", "algo.ref_update_interval=2",
                       "trainer.lr=1e-3", f"trainer.total_steps={steps}")
    _, rows = finished(run_dir, proc, steps)
    kl = [r["train/reward_kl"] for r in rows]
    # measured: [0, 0.0064, 0, 0.0018, 0] (torch), [0, 0.0145, 0, 0.0061, 0] (megatron, ppo)
    assert kl[0] == 0.0  # step 1: the policy is model.path, as the reference
    # the policy and the copy run the same forward on the same weights: exactly equal log-probs
    assert kl[2] == 0.0 and kl[4] == 0.0, kl
    assert kl[1] > 0 and kl[3] > 0, kl


# reward first >= 0.8 at step 44 / 64 / 45 for three tiny model seeds (session 12's machine); on
# session 34's, seed 0's run (bitwise repeatable there) first had a 3-step mean >= 0.8 at step 98
# and ended its 100 steps at 0.803: the run ends where it gets there, 150 steps the bound
PPO_STEPS = 150




@pytest.mark.slow
def test_ppo_with_a_critic_learns_the_tiny_task(tmp_path, tiny_assets):
    """`experiment=tiny_cpu algo=ppo` as a user types it: a value model trained beside the
    policy, GAE advantages, the presets' four PPO mini-batch steps per rollout batch and the tiny
    task's PPO lr 1e-3 (critic 5e-3; conf/algo_trainer/ppo.yaml, conf/tuning/tiny_cpu_ppo.yaml;
    docs/algorithms.md#ppo-with-a-critic): the issue's claim, reward from <= 0.3 to >= 0.8,
    within PPO_STEPS, where the run ends. Run to 100 steps, steps 97-99 gave 0.95 / 0.87 / 0.95
    for model seeds 0 / 1 / 2 on session 12's machine."""
    run_dir = tmp_path / "ppo"
    proc = relax_train(run_dir, tiny_assets, ONE_RANK, "metrics.progress=false", "algo=ppo",
                       f"trainer.total_steps={PPO_STEPS}", *until_reward(0.8))
    summary, rows = finished(run_dir, proc, None)  # ended where it reached 0.8
    assert summary["reward_first"] <= 0.3 and summary["reward_last"] >= 0.8, summary
    # the critic learned the returns: its loss fell from where the untrained value head is
    early = sum(r["critic/vf_loss"] for r in rows[20:30]) / 10
    late = sum(r["critic/vf_loss"] for r in rows[-10:]) / 10
    assert late < early / 2, (early, late)
    assert {"critic/values_mean", "critic/returns_mean", "critic/grad_norm"} <= set(rows[-1])
