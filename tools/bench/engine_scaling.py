"""Part 7: rollout throughput with more engines (what an elastic scale-out buys).

The same strictly on-policy run with 1 and with 3 engines, interleaved per repeat, in a
rollout-bound configuration: an engine takes at most 64 sequences at once
(`rollout.engine_max_batch_size`, like SGLang's --max-running-requests) and a step's 512
sequences come in 8 requests, so one engine works through them in turn while several share
them. The figure is the median time to generate one step's batch (`perf/gen_time_s`) with one
engine over that with three: a ratio of two runs of this invocation.

On a cluster each engine brings its own GPUs and the ratio approaches the engine count; on a
2-core machine every engine, the worker and the broker share two cores, so it cannot pass 2 and
measures how much of the rollout is engine compute at all.
"""

from __future__ import annotations

from pathlib import Path

from common import Run, relax_train, spread

ROLLOUT_BOUND = ("trainer.nproc_per_node=1", "algo.max_staleness=0",
                 "rollout.groups_per_request=4", "rollout.engine_max_batch_size=64")
ENGINES = (1, 3)


def measure(out: Path, model: Path, data: Path, *, steps: int, repeats: int) -> dict:
    runs: dict[int, list[Run]] = {n: [] for n in ENGINES}
    for rep in range(repeats):  # interleaved, so a drift of the machine hits both alike
        for n in ENGINES:
            run = relax_train(out / f"engines{n}_rep{rep}", model, data, *ROLLOUT_BOUND,
                              f"rollout.num_engines={n}", f"trainer.total_steps={steps}")
            print(f"  {n} engine(s) rep {rep}: generate {run.median('perf/gen_time_s'):.3f} s "
                  f"a step, {run.samples_per_s():.0f} samples/s", flush=True)
            runs[n].append(run)
    one, three = runs[ENGINES[0]], runs[ENGINES[1]]
    return {
        "gen_s": {str(n): spread([r.median("perf/gen_time_s") for r in rs])
                  for n, rs in runs.items()},
        "samples_per_s": {str(n): spread([r.samples_per_s() for r in rs])
                          for n, rs in runs.items()},
        "gen_speedup": spread([a.median("perf/gen_time_s") / b.median("perf/gen_time_s")
                               for a, b in zip(one, three)]),
        "samples_per_s_ratio": spread([b.samples_per_s() / a.samples_per_s()
                                       for a, b in zip(one, three)]),
    }
