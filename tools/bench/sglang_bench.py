"""Part 10: the tiny task on the real SGLang server, beside the hf engine's rows (issue #36 item
3).

`relax-train experiment=tiny_cpu rollout=sglang` starts SGLang's own `sglang.launch_server`
from the project's CPU venv (docs/engines.md#sglang-on-cpu; the launcher builds it on first
use), pinned as part 1 (rollout, here SGLang's server, scheduler and detokenizer with the
worker, on core 0; the trainer on core 1; one torch thread each). Modes, interleaved per
repeat:

- sync: `algo.max_staleness=0`, the engine idle while the trainer steps;
- async: `algo.max_staleness=1`, generation beside training;
- colocated: sync with `rollout.release_memory_during_train=true`, the shared-GPU schedule
  (the engine releases its memory while the trainer steps and takes each push through
  `/update_weights_from_tensor`).

Runs of 40 steps (quick) or 60 (full: the figures are throughput ratios, which need the steady
state only; what SGLang learns is the end-to-end tests' business), ~65 s each with SGLang's
~25 s start.

Figures: samples/s async / sync and async / colocated, and the rollout overhead of the sync run
(the trainer's wait for a batch / its generation span), each a ratio of runs of this
invocation, next to part 1's and part 9's on the hf engine. SGLang on 2 CPU cores is a
functional server, not a fast one: its scheduler's per-request work makes a step's generation
~10x the hf engine's here, so generation dominates every mode and bounds what async can gain.
"""

from __future__ import annotations

from pathlib import Path

from async_sync import PINNED
from common import Run, relax_train, spread

MODES = {"sync": ("algo.max_staleness=0",),
         "async": ("algo.max_staleness=1",),
         "colocated": ("algo.max_staleness=0", "rollout.release_memory_during_train=true")}


def measure(out: Path, model: Path, data: Path, *, steps: int, repeats: int
            ) -> tuple[dict, dict[str, list[Run]]]:
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    for rep in range(repeats):  # interleaved, so a drift of the machine hits every mode alike
        for mode, overrides in MODES.items():
            run = relax_train(out / f"sglang_{mode}_rep{rep}", model, data, "rollout=sglang",
                              *PINNED, *overrides, f"trainer.total_steps={steps}",
                              f"trainer.lr_decay_steps={steps}", f"seed={rep}")
            print(f"  sglang {mode} rep {rep}: {run.samples_per_s():.0f} samples/s, "
                  f"generate {run.median('perf/gen_time_s'):.3f} s a step, final reward "
                  f"{run.final_reward():.3f}", flush=True)
            runs[mode].append(run)
    return summarize(runs), runs


def summarize(runs: dict[str, list[Run]]) -> dict:
    """Per mode, then the ratios of repeat i's runs, min / median / max."""
    out: dict = {"modes": {}}
    for mode, rs in runs.items():
        out["modes"][mode] = {
            "samples_per_s": spread([r.samples_per_s() for r in rs]),
            "step_s": spread([r.median("perf/step_time_s") for r in rs]),
            "gen_time_s": spread([r.median("perf/gen_time_s") for r in rs]),
            "trainer_wait_s": spread([r.median("perf/trainer_wait_s") for r in rs]),
            "train_time_s": spread([r.median("perf/train_time_s") for r in rs]),
            "weight_sync_s": spread([r.median("perf/weight_sync_s") for r in rs]),
            "final_reward": spread([r.final_reward() for r in rs]),
            "wall_s": spread([r.wall_s for r in rs]),
        }
    sync, asyn, colo = runs["sync"], runs["async"], runs["colocated"]
    out["async_speedup"] = spread([a.samples_per_s() / s.samples_per_s()
                                   for s, a in zip(sync, asyn)])
    out["async_over_colocated"] = spread([a.samples_per_s() / c.samples_per_s()
                                          for c, a in zip(colo, asyn)])
    out["rollout_overhead_ratio"] = spread([
        r.median("perf/trainer_wait_s") / r.median("perf/gen_time_s") for r in sync])
    return out
