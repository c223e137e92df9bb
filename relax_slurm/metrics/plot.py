"""`relax-plot RUN_DIR`: PNG curves of a run (finished or still running) in RUN_DIR/plots/.

One PNG per panel (plots/<panel>.png) for linking and diffing, plus plots/overview.png with
every panel that has data, for a glance. Reads metrics.jsonl as it is: a line being written
right now is skipped, so plotting a live run is safe.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_slurm.metrics.jsonl import read_metrics

PLOTS_DIR = "plots"
OVERVIEW = "overview"


@dataclass(frozen=True)
class Panel:
    name: str
    """File name (plots/<name>.png) and the overview's subplot id."""
    title: str
    keys: tuple[str, ...]
    """Metric keys drawn as lines; a key ending in '/' draws every key under that prefix."""
    stacked: bool = False
    """Stack the keys (parts of one total, e.g. time per step)."""


PANELS = (
    Panel("reward", "reward (mean over the batch)", ("rollout/reward_mean",)),
    Panel("eval", "eval", ("eval/",)),
    Panel("response_length", "response length (tokens)",
          ("rollout/response_len_mean",)),
    Panel("truncated", "truncated fraction", ("rollout/truncated_frac",)),
    Panel("clipfrac", "PPO clip fraction", ("train/clipfrac", "train/tis_masked_frac")),
    Panel("kl", "KL / train-rollout log-prob diff",
          ("train/kl", "train/kl_loss", "train/rollout_train_logprob_diff")),
    Panel("entropy", "entropy (nats/token)", ("train/entropy",)),
    Panel("staleness", "staleness (policy versions)",
          ("broker/staleness_max", "broker/staleness_mean", "broker/dropped_stale")),
    Panel("staleness_hist", "share of samples by staleness", ("broker/staleness_hist/",),
          stacked=True),
    Panel("throughput", "throughput (samples/s)", ("perf/samples_per_s",)),
    Panel("time_breakdown", "time per step (s)",
          ("perf/trainer_wait_s", "perf/train_time_s", "perf/weight_sync_s",
           "perf/checkpoint_s"), stacked=True),
)


def series(rows: list[dict[str, Any]], panel: Panel) -> dict[str, tuple[list[int], list[float]]]:
    """Pure: rows -> {key: (steps, values)} for the panel's keys that have any number."""
    keys: list[str] = []
    for k in panel.keys:
        if k.endswith("/"):
            keys += sorted({key for r in rows for key in r if key.startswith(k)})
        else:
            keys.append(k)
    out = {}
    for key in keys:
        pts = [(r["step"], float(r[key])) for r in rows
               if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if pts:
            out[key] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def draw(ax, panel: Panel, data: dict[str, tuple[list[int], list[float]]]) -> None:
    if panel.stacked:
        # one step axis for all parts: stackplot needs aligned series
        steps = data[next(iter(data))][0]
        parts = [v for _, v in data.values() if len(v) == len(steps)]
        labels = [k.split("/")[-1] for k, (_, v) in data.items() if len(v) == len(steps)]
        ax.stackplot(steps, parts, labels=labels, alpha=0.8)
    else:
        for key, (steps, values) in data.items():
            ax.plot(steps, values, label=key, marker="." if len(steps) < 30 else None)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write one PNG per panel with data, then overview.png; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out_dir = run_dir / PLOTS_DIR
    out_dir.mkdir(exist_ok=True)
    filled = [(p, d) for p in PANELS if (d := series(rows, p))]
    written = []
    for panel, data in filled:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        draw(ax, panel, data)
        fig.tight_layout()
        written.append(out_dir / f"{panel.name}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    if filled:
        cols = 3
        nrows = -(-len(filled) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.2 * nrows), squeeze=False)
        for ax, (panel, data) in zip(axes.flat, filled):
            draw(ax, panel, data)
        for ax in list(axes.flat)[len(filled):]:
            ax.set_visible(False)
        fig.suptitle(f"{run_dir.name}: {len(rows)} steps")
        fig.tight_layout()
        written.append(out_dir / f"{OVERVIEW}.png")
        fig.savefig(written[-1], dpi=90)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        sys.exit(f"relax-plot: {args.run_dir} is not a run directory")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("relax-plot needs matplotlib: `pip install matplotlib` "
                 "(or `pip install relax-slurm[observability]`)")
    written = plot_run(args.run_dir)
    if not written:
        sys.exit(f"relax-plot: no metrics yet in {args.run_dir / 'metrics.jsonl'}")
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
