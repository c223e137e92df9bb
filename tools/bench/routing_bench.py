"""What rollout routing replay (R3) costs: the tiny MoE preset (experiment=tiny_moe_cpu) with
routing off (rollout.return_routed_experts=false), recorded and compared only (the default),
and replayed (algo.routing_replay=true), interleaved repeats of the same run.

The engine records every token's experts with router hooks and returns them as base64; the
worker decodes them into the samples (int16, through the broker); the trainer scatters them to
its ranks and, per MoE layer, compares (and replays) them. The figures: median trainer time and
step time per step of each mode over the off mode's, measured in this invocation.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common import REPO, Run, relax_train, spread

MODES = {
    "off": ("rollout.return_routed_experts=false",),
    "recorded": (),
    "replayed": ("algo.routing_replay=true",),
}


def make_moe(out: Path) -> Path:
    model = out / "moe_model"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(model),
                        "--kind", "moe"], cwd=REPO, check=True, capture_output=True)
    return model


def measure(out: Path, data: Path, steps: int, repeats: int) -> dict:
    model = make_moe(out / "assets")
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    for rep in range(repeats):
        for mode, overrides in MODES.items():  # interleaved: drift hits every mode alike
            run = relax_train(out / "routing" / f"{mode}_rep{rep}", model, data,
                              f"trainer.total_steps={steps}", "trainer.nproc_per_node=1",
                              *overrides)
            print(f"  routing {mode} rep {rep}: train {run.median('perf/train_time_s'):.3f} s, "
                  f"step {run.median('perf/step_time_s'):.3f} s", flush=True)
            runs[mode].append(run)
    res: dict = {"modes": {}}
    for mode, rs in runs.items():
        res["modes"][mode] = {"train_s": spread([r.median("perf/train_time_s") for r in rs]),
                              "step_s": spread([r.median("perf/step_time_s") for r in rs]),
                              "final_reward": spread([r.final_reward() for r in rs])}
    for mode in ("recorded", "replayed"):
        res[f"{mode}_train_ratio"] = spread([
            r.median("perf/train_time_s") / o.median("perf/train_time_s")
            for r, o in zip(runs[mode], runs["off"])])
        res[f"{mode}_step_ratio"] = spread([
            r.median("perf/step_time_s") / o.median("perf/step_time_s")
            for r, o in zip(runs[mode], runs["off"])])
    return res
