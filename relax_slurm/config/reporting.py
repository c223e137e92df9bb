"""`metrics`, `notify`, `debug`: what a run reports (progress, TensorBoard, wandb,
notifications, dumped rollouts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from relax_slurm.config.check import check

@dataclass(kw_only=True)
class WandbConfig:
    enabled: bool = False
    """Log every metrics row to Weights & Biases as well (needs `pip install wandb`)."""
    mode: str = "auto"
    """auto: online when WANDB_API_KEY is set, offline otherwise; or online, offline."""
    project: str = "relax-slurm"
    entity: Optional[str] = None
    """wandb team or user; null: the API key's default entity."""
    name: Optional[str] = None
    """Run name; null: the run directory's name."""
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check(self.mode in ("auto", "online", "offline"),
               f"metrics.wandb.mode={self.mode!r}: use auto, online or offline")


@dataclass(kw_only=True)
class MetricsConfig:
    progress: bool = True
    """Progress bar on a terminal, plain lines otherwise."""
    log_every: int = 1
    tensorboard: bool = False
    """Also write TensorBoard event files to run_dir/tensorboard (needs `pip install
    tensorboard`)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(kw_only=True)
class DebugConfig:
    dump_rollouts: bool = False
    """Write every trained sample (prompt, response, reward, version) to
    run_dir/rollouts/step_NNNNNN.jsonl, one file per step."""


@dataclass(kw_only=True)
class NotifyConfig:
    urls: list[str] = field(default_factory=list)
    """Apprise URLs (slack://..., mailto://..., json://host:port/...); empty: no notifications.
    Needs `pip install apprise`; without it the run warns once and goes on."""
    every_steps: int = 0
    """Also send the latest key metrics every this many steps; 0: only start, end and crash."""

    def __post_init__(self) -> None:
        check(self.every_steps >= 0, f"notify.every_steps={self.every_steps}: must be >= 0")
