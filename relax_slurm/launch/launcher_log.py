"""RUN_DIR/launcher.log: what relax-train prints for a local run (its notices, the plain
progress lines, the summary, an error, the `resume with:` line), kept with the run. The terminal
still gets everything; tqdm's redrawn bar (`\\r` updates) stays on the terminal only. On Slurm
the driver's output goes to the job's --output, RUN_DIR/slurm-<job>.out (docs/slurm.md)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import IO, Any, Iterator

LAUNCHER_LOG = "launcher.log"


class Tee:
    """A text stream that writes to `stream` and appends to `log` (not tqdm's redraws)."""

    def __init__(self, stream: IO[str], log: IO[str]) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        if "\r" not in text and not self.log.closed:
            self.log.write(text)
            self.log.flush()  # the file is complete however relax-train ends
        return n

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:  # progress bars only where the real stream is a terminal
        return self.stream.isatty()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, ...: the real stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def tee_output(path: Path) -> Iterator[None]:
    """sys.stdout and sys.stderr also append to `path` inside the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out, err = sys.stdout, sys.stderr
    with path.open("a", encoding="utf-8") as log:
        sys.stdout, sys.stderr = Tee(out, log), Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err
