"""Part 9: the long-tail workload (experiment=tiny_longtail_cpu), colocated sync against async.

The task ("d*n=" -> d repeated n times, n heavy-tailed; relax_slurm/tiny/longtail.py) makes
response lengths run from 1 to 31 tokens, most short. Modes, interleaved per repeat:

- colocated: what a colocated GPU job does, generate then train on the same devices: strictly
  on-policy (`algo.max_staleness=0`), no pinning, engine and trainer with 2 torch threads each,
  so each phase may use both cores while the other waits;
- colocated_1t: the same with one torch thread per process (a control: on a machine shared
  with other jobs, 2-thread processes lose far more to oversubscription than 1-thread ones);
- async: `algo.max_staleness=1`, streaming training and the overlapped weight sync on,
  rollout on core 0 and trainer on core 1 (one thread each);
- async_no_overlap: the same with `weight_sync.overlap=false`, for the sync share of a step;
- tiny_sync: experiment=tiny_cpu on-policy and pinned (as part 1's sync run), for the rollout
  overhead of the short task.

Every run trains on 16 prompt groups of 16 a step (the preset's 32 halved: the whole part must
fit in half an hour of a shared 2-core machine). The async_no_overlap runs also dump their
rollouts (`debug.dump_rollouts=true`) for the response-length distribution; decoding and
writing 256 samples lands in the next step's time, so their sync share is a little low.

Figures: samples/s and time to a fixed reward, async / colocated; final rewards;
`rollout_overhead_ratio` = the trainer's wait for a batch in a sync run / the batch's
generation span (`perf/gen_time_s`: the worker's first request sent to its last answer parsed,
the engines' HTTP and JSON inside), so 1.0 means the worker's scoring and building, the broker
and the trainer's take add nothing to generation; the sync
share of the step (`perf/weight_sync_s / perf/step_time_s`) with the overlap on and off.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from async_sync import PINNED
from common import Run, load_run, spread
from common import relax_train as _relax_train

EXPERIMENT = "tiny_longtail_cpu"
REWARD_THRESHOLD = 0.1  # reached by every mode within 40 steps of 256 samples (prefix_match)
BATCH = ("rollout.batch_size=16",)
COLOCATED = ("trainer.nproc_per_node=1", "trainer.torch_threads=2", "rollout.torch_threads=2",
             "algo.max_staleness=0")
ASYNC = (*PINNED, "algo.max_staleness=1", "trainer.streaming=true", "weight_sync.overlap=true")
MODES = {"colocated": COLOCATED,
         "colocated_1t": ("trainer.nproc_per_node=1", "trainer.torch_threads=1",
                          "rollout.torch_threads=1", "algo.max_staleness=0"),
         "async": ASYNC,
         "async_no_overlap": (*ASYNC[:-1], "weight_sync.overlap=false",
                              "debug.dump_rollouts=true")}


def sync_bound(run: Run) -> float:
    """A sync run's step / (its wait for a batch + train + weight sync), step by step."""
    return run.per_step("perf/step_time_s", "perf/trainer_wait_s", "perf/train_time_s",
                        "perf/weight_sync_s")


def lengths(run_dir: Path) -> dict[str, float]:
    return lengths_of([run_dir])


def lengths_of(run_dirs: list[Path]) -> dict[str, float]:
    """Response lengths (tokens, EOS included) over every dumped sample of the runs and of their
    last 20 steps; `tail`: a step's longest response / its mean, median over the steps."""
    per_run = [sorted((d / "rollouts").glob("step_*.jsonl")) for d in run_dirs]
    files = [f for fs in per_run for f in fs]

    def stats(paths: list[Path]) -> dict[str, float]:
        xs = sorted(json.loads(line)["response_len"] for p in paths
                    for line in p.read_text().splitlines())
        n = len(xs)
        return {"p50": xs[n // 2], "p90": xs[int(n * 0.9)], "p99": xs[int(n * 0.99)],
                "max": xs[-1], "mean": sum(xs) / n, "samples": n}

    tails = []
    for p in files:
        xs = [json.loads(line)["response_len"] for line in p.read_text().splitlines()]
        tails.append(max(xs) * len(xs) / sum(xs))
    return {"all": stats(files), "last20": stats([f for fs in per_run for f in fs[-20:]]),
            "tail": statistics.median(tails)}


def measure(out: Path, model: Path, data: Path, tiny_data: Path, *, steps: int,
            repeats: int, reuse: bool = False) -> tuple[dict, dict[str, list[Run]]]:
    """Run every mode (`reuse`: read the runs a previous invocation finished under `out`)."""
    runs: dict[str, list[Run]] = {m: [] for m in (*MODES, "tiny_sync")}
    common = (f"trainer.total_steps={steps}", f"trainer.lr_decay_steps={steps}")
    order = ("colocated", "async", "tiny_sync", "async_no_overlap", "colocated_1t")

    def relax_train(run_dir: Path, *args, **kw) -> Run:
        if reuse and (run_dir / "summary.json").exists():
            return load_run(run_dir)
        return _relax_train(run_dir, *args, **kw)
    for rep in range(repeats):  # interleaved, so a drift of the machine hits every mode alike
        for mode in order:
            if mode == "tiny_sync":
                run = relax_train(out / f"tiny_sync_rep{rep}", model, tiny_data, *PINNED,
                                  "algo.max_staleness=0", *common)
                print(f"  tiny sync rep {rep}: rollout overhead "
                      f"{run.per_step('perf/trainer_wait_s', 'perf/gen_time_s'):.2f}", flush=True)
            else:
                run = relax_train(out / f"{mode}_rep{rep}", model, data, *MODES[mode], *BATCH,
                                  *common, experiment=EXPERIMENT)
                print(f"  longtail {mode} rep {rep}: {run.samples_per_s():.0f} samples/s, "
                      f"final reward {run.final_reward():.3f}, s to {REWARD_THRESHOLD}: "
                      f"{run.time_to(REWARD_THRESHOLD)}", flush=True)
            runs[mode].append(run)
    dist = {"async_no_overlap": lengths_of([out / f"async_no_overlap_rep{rep}"
                                            for rep in range(repeats)])}
    print(f"  response lengths: {dist}", flush=True)
    return summarize(runs, dist), runs


def summarize(runs: dict[str, list[Run]], dist: dict) -> dict:
    """Ratios per repeat (async rep i against colocated rep i), then min/median/max."""
    out: dict = {"modes": {}, "response_len": dist, "reward_threshold": REWARD_THRESHOLD}
    for mode, rs in runs.items():
        out["modes"][mode] = {
            "samples_per_s": spread([r.samples_per_s() for r in rs]),
            "step_s": spread([r.median("perf/step_time_s") for r in rs]),
            "final_reward": spread([r.final_reward() for r in rs]),
            "time_to_reward_s": spread([r.time_to(REWARD_THRESHOLD) for r in rs]),
            "trainer_wait_s": spread([r.median("perf/trainer_wait_s") for r in rs]),
            "gen_time_s": spread([r.median("perf/gen_time_s") for r in rs]),
            "train_time_s": spread([r.median("perf/train_time_s") for r in rs]),
            "weight_sync_s": spread([r.median("perf/weight_sync_s") for r in rs]),
            "response_len_mean": spread([r.median("rollout/response_len_mean") for r in rs]),
            "sync_share": spread([r.per_step("perf/weight_sync_s", "perf/step_time_s")
                                  for r in rs]),
            "wall_s": spread([r.wall_s for r in rs]),
        }
    pairs = list(zip(runs["colocated"], runs["async"]))
    tt = [(c.time_to(REWARD_THRESHOLD), a.time_to(REWARD_THRESHOLD)) for c, a in pairs]
    out["async_over_colocated"] = spread([a.samples_per_s() / c.samples_per_s()
                                          for c, a in pairs])
    out["async_over_colocated_time_to_reward"] = spread([c / a for c, a in tt if c and a])
    out["reward_delta"] = spread([a.final_reward() - c.final_reward() for c, a in pairs])
    if runs.get("colocated_1t"):
        pairs1 = list(zip(runs["colocated_1t"], runs["async"]))
        out["async_over_colocated_1t"] = spread([a.samples_per_s() / c.samples_per_s()
                                                 for c, a in pairs1])
        out["async_over_colocated_1t_time_to_reward"] = spread([
            c.time_to(REWARD_THRESHOLD) / a.time_to(REWARD_THRESHOLD) for c, a in pairs1
            if c.time_to(REWARD_THRESHOLD) and a.time_to(REWARD_THRESHOLD)])
        out["reward_delta_1t"] = spread([a.final_reward() - c.final_reward() for c, a in pairs1])
    for name, mode in (("rollout_overhead_ratio", "colocated"),
                       ("rollout_overhead_ratio_1t", "colocated_1t"),
                       ("rollout_overhead_ratio_tiny", "tiny_sync")):
        out[name] = spread([r.per_step("perf/trainer_wait_s", "perf/gen_time_s")
                            for r in runs[mode]])
    out["sync_bound_ratio"] = spread([sync_bound(r) for r in runs["colocated"]])
    out["sync_bound_ratio_1t"] = spread([sync_bound(r) for r in runs["colocated_1t"]])
    out["sync_bound_ratio_tiny"] = spread([sync_bound(r) for r in runs["tiny_sync"]])
    return out
