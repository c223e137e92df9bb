"""TensorBoard event files in run_dir/tensorboard, one scalar per metrics key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_slurm.metrics.optional import require

TB_DIR = "tensorboard"


class TensorBoardSink:
    def __init__(self, run_dir: Path) -> None:
        # torch ships the writer; the `tensorboard` package provides the event-file encoder
        require("tensorboard", "metrics.tensorboard=true", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run appends a new event file to the same directory; TensorBoard merges them
        self._w = SummaryWriter(log_dir=str(run_dir / TB_DIR))

    def log(self, step: int, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._w.add_scalar(key, value, global_step=step)
        self._w.flush()  # a step is seconds to minutes: flushing each one costs nothing

    def close(self) -> None:
        self._w.close()
