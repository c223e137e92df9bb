"""LoRA against full fine-tuning (issue #37): bytes per weight sync, sync time, trainer memory.

    python tools/bench/lora_bench.py [--steps 40] [--rank 8] [--engine hf|sglang] [--out lora_out]

Runs `relax-train experiment=tiny_cpu` twice on one trainer rank, the same steps and seed:
model.lora.rank=0 (the baseline: every sync sends every weight, flattened_bucket broadcast) and
model.lora.rank=RANK (each sync sends the adapter alone over the engines' adapter routes).
Per run: `weight_sync/bytes` (every step's, which must be one number), the median
`perf/weight_sync_s` after warm-up, and the trainer's peak resident memory: VmHWM of every
process of the trainer role's tree (the torchrun agent and its rank), read from /proc while
the run goes (VmHWM only grows, so the last read is the peak). Prints a markdown table with the
LoRA/full ratios for docs/benchmarks.md and writes OUT/lora_bench.json. A benchmark run on
demand, not a test (Linux: /proc).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import REPO, WARMUP_STEPS, make_assets
from soak import _children, _tree


def _hwm(pid: int) -> int | None:
    """VmHWM (peak RSS) bytes of one process, None if gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def watch_trainer(run_dir: Path, peaks: dict[int, int], done: threading.Event) -> None:
    """Keep each trainer process's last VmHWM in `peaks` until `done`."""
    while not done.wait(0.5):
        try:
            roles = json.loads((run_dir / "roles.json").read_text())
        except (OSError, ValueError):
            continue
        trainer = next((r for r in roles if r["name"] == "trainer"
                        and isinstance(r.get("pid"), int)), None)
        if trainer is None:
            continue
        for pid in _tree(trainer["pid"], _children()):
            if (hwm := _hwm(pid)) is not None:
                peaks[pid] = max(hwm, peaks.get(pid, 0))


def run(run_dir: Path, model: Path, data: Path, rank: int, steps: int, engine: str) -> dict:
    cmd = [sys.executable, "-m", "relax_slurm.launch.cli", "experiment=tiny_cpu",
           f"run_dir={run_dir}", f"model.path={model}", f"data.train_files=[{data}]",
           "trainer.nproc_per_node=1", f"trainer.total_steps={steps}",
           f"model.lora.rank={rank}", f"rollout={engine}"]
    peaks: dict[int, int] = {}
    done = threading.Event()
    watcher = threading.Thread(target=watch_trainer, args=(run_dir, peaks, done), daemon=True)
    watcher.start()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    done.set()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"relax-train failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sent = {r["weight_sync/bytes"] for r in rows}
    assert len(sent) == 1, f"bytes per sync varied: {sent}"
    return {"rank": rank, "bytes_per_sync": sent.pop(),
            "sync_s_median": statistics.median(r["perf/weight_sync_s"]
                                               for r in rows[WARMUP_STEPS:]),
            "trainer_peak_rss": max(peaks.values()),  # the rank; the agent is far smaller
            "trainer_tree_peak_rss_sum": sum(peaks.values()),
            "reward_last5": sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5}


def table(full: dict, lora: dict, engine: str) -> str:
    def row(name: str, key: str, fmt: str) -> str:
        return (f"| {name} | {format(full[key], fmt)} | {format(lora[key], fmt)} | "
                f"{lora[key] / full[key]:.3g} |")
    return "\n".join([
        f"| tiny_cpu, {engine} engine, 1 rank | full (rank 0) | LoRA rank {lora['rank']} | "
        "LoRA / full |", "|---|---|---|---|",
        row("bytes per sync", "bytes_per_sync", ","),
        row("sync time, median s", "sync_s_median", ".4f"),
        f"| trainer peak RSS (rank's VmHWM), MiB | {full['trainer_peak_rss'] / 2**20:.0f} | "
        f"{lora['trainer_peak_rss'] / 2**20:.0f} | "
        f"{lora['trainer_peak_rss'] / full['trainer_peak_rss']:.3g} |",
        row("reward, mean of last 5 steps", "reward_last5", ".3f")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--engine", default="hf", choices=("hf", "sglang"))
    ap.add_argument("--out", type=Path, default=Path("lora_out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_assets(args.out / "assets")
    data = args.out / "assets" / "arith_train.jsonl"
    t0 = time.monotonic()
    full = run(args.out / "full", model, data, 0, args.steps, args.engine)
    lora = run(args.out / "lora", model, data, args.rank, args.steps, args.engine)
    result = {"full": full, "lora": lora, "engine": args.engine, "steps": args.steps,
              "wall_s": time.monotonic() - t0}
    (args.out / "lora_bench.json").write_text(json.dumps(result, indent=2))
    print(table(full, lora, args.engine))


if __name__ == "__main__":
    main()
