"""Parts 1 and 2: the same GRPO run strictly on-policy (max_staleness=0) and async (1, 2).

Rollout (engine + worker) and trainer get disjoint cores, one each on a 2-core machine
(`cluster.rollout_cpus=[0] cluster.trainer_cpus=[1]`, one torch thread per process), as
separate GPU pools are on a cluster; otherwise both modes fight over the same cores and the
comparison says nothing about overlap.

Bounds (part 2), from per-step metrics of the same bench invocation:
- G, the time to produce one batch with nothing overlapping: the sync run's trainer wait
  (engine generation + worker + broker transfer);
- T, the trainer's own time per step: the sync run's step time minus that wait (train step,
  weight sync, batch preparation, metrics);
- sync:  step time vs G + T's parts (generate + train + weight_sync, the rest is bookkeeping),
  step by step;
- async: step time vs max(G, T), the best any overlap can do; and vs max(generate, train)
  where both are pure compute (`perf/gen_time_s`, `perf/train_time_s`);
- interference: the async run's train and generate times over the sync run's (each on the
  same core, beside the other's work or alone).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from common import Run, relax_train, spread

PINNED = ("trainer.nproc_per_node=1", "cluster.rollout_cpus=[0]", "cluster.trainer_cpus=[1]",
          "trainer.torch_threads=1", "rollout.torch_threads=1")
REWARD_THRESHOLD = 0.5
TRL_THRESHOLD = 0.8  # the "time to reward 0.8", ours against TRL


def run_modes(out: Path, model: Path, data: Path, *, steps: int, repeats: int,
              stalenesses: tuple[int, ...] = (0, 1, 2)) -> dict[int, list[Run]]:
    runs: dict[int, list[Run]] = {s: [] for s in stalenesses}
    # interleaved, so a drift of the machine hits every mode alike; repeat i runs with seed=i
    # (its own rollout draws), so a reward figure spreads over seeds as TRL's does
    for rep in range(repeats):
        for s in stalenesses:
            run = relax_train(out / f"staleness{s}_rep{rep}", model, data, *PINNED,
                              f"algo.max_staleness={s}", f"trainer.total_steps={steps}",
                              f"trainer.lr_decay_steps={steps}", f"seed={rep}")
            print(f"  max_staleness={s} rep {rep}: {run.samples_per_s():.0f} samples/s, "
                  f"final reward {run.final_reward():.3f}", flush=True)
            runs[s].append(run)
    return runs


def sync_components(run: Run) -> dict[str, float]:
    wait = run.median("perf/trainer_wait_s")
    step = run.median("perf/step_time_s")
    # T step by step: a difference of medians is not the median of the steps' differences
    own = statistics.median(r["perf/step_time_s"] - r["perf/trainer_wait_s"]
                            for r in run.steady())
    return {"step_s": step, "G_s": wait, "T_s": own,
            "generate_s": run.median("perf/gen_time_s"),
            "train_s": run.median("perf/train_time_s"),
            "weight_sync_s": run.median("perf/weight_sync_s")}


def summarize(runs: dict[int, list[Run]]) -> dict:
    """Ratios per repeat (async rep i against sync rep i), then min/median/max."""
    sync = runs[0]
    out: dict = {"modes": {}}
    for s, rs in runs.items():
        out["modes"][s] = {
            "samples_per_s": spread([r.samples_per_s() for r in rs]),
            "step_s": spread([r.median("perf/step_time_s") for r in rs]),
            "final_reward": spread([r.final_reward() for r in rs]),
            "time_to_reward_s": spread([r.time_to(REWARD_THRESHOLD) for r in rs]),
            "time_to_0.8_s": spread([r.time_to(TRL_THRESHOLD) for r in rs]),
            "staleness_mean": spread([r.median("broker/staleness_mean") for r in rs]),
            "wall_s": spread([r.wall_s for r in rs]),
        }
    comps = [sync_components(r) for r in sync]
    out["sync_components"] = {k: spread([c[k] for c in comps]) for k in comps[0]}
    best = max(s for s in runs if s > 0)
    for s in (s for s in runs if s > 0):
        pairs = list(zip(sync, runs[s]))
        out[f"staleness{s}"] = {
            "speedup": spread([a.samples_per_s() / b.samples_per_s() for b, a in pairs]),
            "reward_delta": spread([a.final_reward() - b.final_reward() for b, a in pairs]),
            "bound_ratio": spread([a.median("perf/step_time_s") / max(c["G_s"], c["T_s"])
                                   for (b, a), c in zip(pairs, comps)]),
            "bound_ratio_compute": spread([
                a.median("perf/step_time_s") / max(c["generate_s"], c["train_s"])
                for (b, a), c in zip(pairs, comps)]),
            # the same work on the same pinned core, once beside the other core's work and
            # once alone: what the two cores take from each other when both are busy (a VM's
            # neighbours, shared caches), which no overlap can win back and which moves
            # between invocations by itself (session 42: 1.0 one day, 1.1-1.3 the next)
            "train_slowdown": spread([a.median("perf/train_time_s") / b.median("perf/train_time_s")
                                      for b, a in pairs]),
            "gen_slowdown": spread([a.median("perf/gen_time_s") / b.median("perf/gen_time_s")
                                    for b, a in pairs]),
        }
    # step by step (Run.per_step): a sum of medians is not the median of a step's sum
    out["sync_bound_ratio"] = spread([
        r.per_step("perf/step_time_s", "perf/trainer_wait_s", "perf/train_time_s",
                   "perf/weight_sync_s") for r in sync])
    out["sync_bound_ratio_compute"] = spread([
        r.per_step("perf/step_time_s", "perf/gen_time_s", "perf/train_time_s",
                   "perf/weight_sync_s") for r in sync])
    out["best_staleness"] = best
    return out
