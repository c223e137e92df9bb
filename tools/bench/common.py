"""What every benchmark part shares: the machine, repeat statistics, running `relax-train`.

The parts are run by `tools/bench/run.py`; each returns plain dicts that run.py writes to
`bench_results.json` and `docs/benchmarks.md`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WARMUP_STEPS = 2  # the first steps pay lazy initialisation (allocator, gloo, HTTP pools)


def spread(xs: list[float]) -> dict[str, float]:
    """min / median / max of repeated measurements (one value when not repeated), and the
    relative spread (max - min) / |median|: how far one repeat can land from another, the
    figure that says whether a difference between two runs means anything (nan for fewer
    than two finite values)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan"), "n": 0,
                "rel_spread": float("nan")}
    med = statistics.median(xs)
    finite = [x for x in xs if math.isfinite(x)]
    rel = ((max(finite) - min(finite)) / abs(med)
           if len(finite) >= 2 and math.isfinite(med) and med != 0 else float("nan"))
    return {"min": min(xs), "median": med, "max": max(xs), "n": len(xs), "rel_spread": rel}


def machine() -> dict[str, object]:
    """The facts a reader needs to compare numbers across machines."""
    import torch
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "load_avg_at_start": os.getloadavg()[0]}


def make_assets(out: Path, hidden_size: int = 64, layers: int = 2) -> Path:
    """The tiny model (and the arithmetic data) the parts share, built by the real tools."""
    model = out / f"model_h{hidden_size}_l{layers}"
    if not (model / "config.json").exists():
        heads = max(2, hidden_size // 16)
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(model),
                        "--hidden-size", str(hidden_size), "--layers", str(layers),
                        "--heads", str(heads), "--kv-heads", str(max(1, heads // 2)),
                        "--head-dim", "16", "--intermediate-size", str(2 * hidden_size)],
                       cwd=REPO, check=True, capture_output=True)
    if not (out / "arith_train.jsonl").exists():
        subprocess.run([sys.executable, "tools/prepare_data.py", "--out", str(out)],
                       cwd=REPO, check=True, capture_output=True)
    return model


@dataclass
class Run:
    """One `relax-train` run's per-step metrics, reduced to what the benchmarks compare."""
    rows: list[dict]
    wall_s: float
    summary: dict = field(default_factory=dict)

    def steady(self) -> list[dict]:
        return self.rows[WARMUP_STEPS:]

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.steady())

    def per_step(self, num: str, *den: str) -> float:
        """Median over steady steps of num / (the sum of den), steps with a zero sum left out.

        A step's parts add up within the step, not across medians: a median of a sum is not
        the sum of its medians once the parts' distributions are skewed, and on a tiny
        workload the sync run's step / (median wait + median train + median sync) moved
        1.00-1.06 between repeats of one invocation while the same ratio taken step by step
        stayed 1.012-1.013 (session 42, docs/benchmarks.md)."""
        ratios = [r[num] / d for r in self.steady() if (d := sum(r[k] for k in den)) > 0]
        return statistics.median(ratios)

    def samples_per_s(self) -> float:
        rows = self.steady()
        return sum(r["train/samples"] for r in rows) / sum(r["perf/step_time_s"] for r in rows)

    def curve(self, smooth: int = 5) -> tuple[list[float], list[float]]:
        """(training seconds since the first step, reward smoothed over `smooth` steps)."""
        t, xs, out = 0.0, [], []
        for r in self.rows:
            t += r["perf/step_time_s"]
            xs.append(t)
        rewards = [r["rollout/reward_mean"] for r in self.rows]
        for i in range(len(rewards)):
            window = rewards[max(0, i - smooth + 1):i + 1]
            out.append(sum(window) / len(window))
        return xs, out

    def time_to(self, threshold: float) -> float | None:
        for t, r in zip(*self.curve()):
            if r >= threshold:
                return t
        return None

    def final_reward(self, last: int = 10) -> float:
        tail = self.rows[-last:]
        return sum(r["rollout/reward_mean"] for r in tail) / len(tail)


def relax_train(run_dir: Path, model: Path, data: Path, *overrides: str,
                timeout_s: float = 1800, experiment: str = "tiny_cpu") -> Run:
    """`relax-train experiment=tiny_cpu` (or `experiment`) with the bench's model, data and
    overrides."""
    cmd = [sys.executable, "-m", "relax_slurm.launch.cli", f"experiment={experiment}",
           f"run_dir={run_dir}", f"model.path={model}", f"data.train_files=[{data}]", *overrides]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"relax-train failed ({proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return load_run(run_dir, wall)


def load_run(run_dir: Path, wall_s: float | None = None) -> Run:
    """A finished run's metrics (wall time from its summary unless given)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return Run(rows=rows, wall_s=summary["wall_s"] if wall_s is None else wall_s,
               summary=summary)
