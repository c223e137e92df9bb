"""summary.json: the few numbers that say whether a run worked, derived from metrics.jsonl."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUMMARY_FILE = "summary.json"
EDGE_STEPS = 3  # reward_first / reward_last average this many steps to smooth sampling noise


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict[str, Any]], wall_s: float, max_staleness: int) -> dict[str, Any]:
    """Pure: metrics rows (one per step) -> summary dict. `steps` and the rewards cover every
    row of the run directory (resumed starts included); `wall_s` is the caller's, the last
    start's wall time (docs/quickstart.md)."""
    rewards = [r["rollout/reward_mean"] for r in rows if r.get("rollout/reward_mean") is not None]
    stale = [r.get("broker/staleness_max") or 0 for r in rows]
    vals = [r["val/loss"] for r in rows if r.get("val/loss") is not None]
    sft = {"val_loss_first": vals[0], "val_loss_last": vals[-1]} if vals else {}  # algo=sft
    return sft | {
        "steps": len(rows),
        "reward_first": _mean(rewards[:EDGE_STEPS]),
        "reward_last": _mean(rewards[-EDGE_STEPS:]),
        "samples_trained": int(sum(r.get("train/samples", 0) for r in rows)),
        "samples_dropped_stale": (int(rows[-1].get("broker/dropped_stale_samples", 0))
                                  if rows else 0),
        "staleness_max_seen": max(stale) if stale else 0,
        "wall_s": round(wall_s, 3),
        "max_staleness": max_staleness,
    }


def reached(rewards: Sequence[float], target: float, window: int) -> float | None:
    """The mean of the last `window` rewards when there are that many and it is at least
    `target`; None otherwise."""
    if len(rewards) < window:
        return None
    mean = sum(rewards[-window:]) / window
    return mean if mean >= target else None


def first_reached(rewards: Sequence[float], target: float, window: int) -> int | None:
    """The number of steps after which the mean of the last `window` of `rewards` (one per
    step) first was at least `target`, or None: where a run given that target stops (or, when
    that is its last step, ends anyway). summary.json's `stop_at.reached_at_step`
    (trainer.stop_at, trainer/stop_at.py)."""
    for done in range(window, len(rewards) + 1):  # the live check's arithmetic, window by window
        if reached(rewards[done - window:done], target, window) is not None:
            return done
    return None


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f".{SUMMARY_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)  # atomic: `relax-ctl stop --wait` reads it as soon as it appears
    return path


def samples_lost(counters: dict[str, int], rows: list[dict[str, Any]], batch_size: int,
                 samples_per_group: int) -> int:
    """Samples the broker accepted that were neither trained, nor dropped as stale, nor still
    queued at the end: accepted - trained - dropped_stale - queued, from the broker's final
    counters (groups; `counters` as its /status has them) and the trainer's rows. Steps before
    the first logged one (a run resumed from another run's checkpoint) count as trained: the
    broker's restored counters include them."""
    c = counters
    trained = sum(r.get("train/samples", 0) for r in rows) / samples_per_group
    if rows:
        trained += rows[0]["step"] * batch_size
    lost_groups = c["accepted"] - c["dropped"] - c["queue_depth"] - trained
    return int(round(lost_groups * samples_per_group))
