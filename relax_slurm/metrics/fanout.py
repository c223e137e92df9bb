"""One place that sends each metrics row everywhere: metrics.jsonl always, TensorBoard and wandb
when configured. The trainer's rank 0 owns the only instance, so no row is written twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from relax_slurm.config.schema import TrainConfig
from relax_slurm.metrics.jsonl import MetricsWriter
from relax_slurm.metrics.optional import check_available


class Sink(Protocol):
    def log(self, step: int, row: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class FanOut:
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, step: int, row: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(cfg: TrainConfig, run_dir: Path) -> FanOut:
    """jsonl first: a missing optional package fails here, before any step is trained."""
    sinks: list[Sink] = [MetricsWriter(run_dir)]
    if cfg.metrics.tensorboard:
        from relax_slurm.metrics.tensorboard import TensorBoardSink
        sinks.append(TensorBoardSink(run_dir))
    if cfg.metrics.wandb.enabled:
        from relax_slurm.metrics.wandb_run import WandbSink
        sinks.append(WandbSink(cfg, run_dir))
    return FanOut(sinks)


def check_installed(cfg: TrainConfig) -> None:
    """Fail at launch, naming the key and the pip command, when a configured sink's package is
    missing (the trainer would otherwise find out only after the engines have loaded)."""
    if cfg.metrics.tensorboard:
        check_available("tensorboard", "metrics.tensorboard=true", "tensorboard")
    if cfg.metrics.wandb.enabled:
        check_available("wandb", "metrics.wandb.enabled=true", "wandb")
