"""Progress display: a tqdm bar on a terminal, plain log lines otherwise (Slurm logs)."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

PLAIN_EVERY_S = 10.0  # plain mode: at most one line per this many seconds, plus the last step


def _fmt(row: dict[str, Any]) -> dict[str, str]:
    def g(k: str, fmt: str) -> str:
        v = row.get(k)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    if "sft/epoch" in row:  # an SFT run (algo=sft): no rollout, a loss to watch
        return {"loss": g("train/loss", ".3f"), "val": g("val/loss", ".3f"),
                "epoch": g("sft/epoch", ".2f"), "s/step": g("perf/step_time_s", ".2f")}
    return {
        "reward": g("rollout/reward_mean", ".3f"),
        "len": g("rollout/response_len_mean", ".1f"),
        "stale": g("broker/staleness_max", "d"),
        "s/step": g("perf/step_time_s", ".2f"),
    }


class Progress:
    """Steps done out of `total_steps`, from the step each metrics row names (not a count of
    rows: a resumed run's file still holds the rows before its checkpoint, and the trainer
    rewrites it). `start_step`: the checkpoint's step; rows before it are not this run's."""

    def __init__(self, total_steps: int, enabled: bool = True, start_step: int = 0) -> None:
        self.total = total_steps
        self.start = start_step
        self.tty = enabled and sys.stdout.isatty()
        self.enabled = enabled
        self.bar = (tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         dynamic_ncols=True) if self.tty else None)
        self.t0 = time.monotonic()
        self.last_print = 0.0

    def update(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0)) + 1  # steps done once this row's step is
        if step <= self.start:
            return
        fields = _fmt(row)
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last_print < PLAIN_EVERY_S and step < self.total:
            return
        self.last_print = now
        elapsed = now - self.t0
        eta = elapsed / (step - self.start) * (self.total - step)
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"step {step}/{self.total} {text} elapsed={elapsed:.0f}s eta={eta:.0f}s", flush=True)

    def note(self, text: str) -> None:
        """A line of its own on stderr, with the launcher's other notes (above the bar on a
        terminal); said with metrics.progress=false too."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
