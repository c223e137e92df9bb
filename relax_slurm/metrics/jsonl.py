"""metrics.jsonl: one JSON line per training step, written by the trainer's rank 0 only."""

from __future__ import annotations

import json
import math
import os
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


class MetricsTail:
    """New rows of a growing metrics.jsonl, read incrementally (the file is never re-parsed).

    A resumed trainer replaces the file with one cut at its checkpoint's step: then reading
    starts over and `count` (rows in the file as last read) drops accordingly."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self._partial, self.count = path, 0, b"", 0
        self._file_id: tuple[int, int] | None = None

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                st = os.fstat(f.fileno())
                # replaced (a resume writes a new file) or cut short in place: start over
                if (st.st_dev, st.st_ino) != self._file_id or st.st_size < self._offset:
                    self._offset, self._partial, self.count = 0, b"", 0
                    self._file_id = (st.st_dev, st.st_ino)
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # an incomplete last line, finished by a later read
        rows = [json.loads(line) for line in lines if line.strip()]
        self.count += len(rows)
        return rows


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


def truncate_metrics(run_dir: Path, start_step: int) -> None:
    """On resume, forget steps logged after the checkpoint: they are trained again."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) < start_step]
    # a new file put in place, not the old one rewritten: the launcher tails this file, and a
    # rewrite that grew past its read offset before its next read looked like more rows
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in rows))
    tmp.replace(path)
