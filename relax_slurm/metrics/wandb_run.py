"""Weights & Biases: one wandb run per relax run, resumed under the same id after a restart.

The id lives in run_dir/wandb_id, so a requeued Slurm job (same run directory, new
allocation) keeps appending to the run it started rather than opening a new one.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Any

from relax_slurm.config.reporting import WandbConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.metrics.optional import require

ID_FILE = "wandb_id"


def wandb_mode(cfg: WandbConfig, env: dict[str, str]) -> str:
    """auto -> online only with an API key: a compute node without one must not hang on login."""
    if cfg.mode != "auto":
        return cfg.mode
    return "online" if env.get("WANDB_API_KEY") else "offline"


def run_id(run_dir: Path, new_id: str) -> str:
    """The id stored in the run directory, or `new_id`, stored for the next start."""
    path = run_dir / ID_FILE
    if path.exists():
        return path.read_text().strip()
    path.write_text(new_id + "\n")
    return new_id


class WandbSink:
    def __init__(self, cfg: TrainConfig, run_dir: Path) -> None:
        wandb = require("wandb", "metrics.wandb.enabled=true", "wandb")
        w = cfg.metrics.wandb
        self._run = wandb.init(
            project=w.project, entity=w.entity, name=w.name or run_dir.name, tags=list(w.tags),
            id=run_id(run_dir, secrets.token_hex(4)), resume="allow",
            mode=wandb_mode(w, dict(os.environ)), dir=str(run_dir),
            config=asdict(cfg),  # logged once, at init; a resume keeps the first one
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, row: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in row.items() if v is not None}, step=step)

    def close(self) -> None:
        self._run.finish()
