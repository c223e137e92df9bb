"""metrics.jsonl: one JSON line per training step, written by the trainer's rank 0 only."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

METRICS_FILE = "metrics.jsonl"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a missing value reads clearer than a crash
    return value


class MetricsWriter:
    """Append-only writer; each line is flushed so a crash loses at most the current step."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self._f = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return list(iter_metrics(Path(run_dir) / METRICS_FILE))


def iter_metrics(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    with path.open() as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    return  # a line being written right now; the next read gets it
