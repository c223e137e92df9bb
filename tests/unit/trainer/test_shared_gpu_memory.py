"""Shared GPUs (rollout.release_memory_during_train): after its step the trainer drops its
gradients before the engines wake on the same GPUs (the next step sets them to None first
anyway, so nothing is lost), and on CUDA hands the allocator's cached blocks back."""

from __future__ import annotations

import torch

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.trainer.model import single_process_group


def test_the_steps_gradients_are_freed_before_the_engines_wake(tmp_path):
    from relax_slurm.tiny.model import main
    from relax_slurm.trainer.backend import TorchBackend

    assert main(["--out", str(tmp_path / "m")]) == 0
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), model=ModelConfig(path=str(tmp_path / "m")),
                      algo=AlgoConfig(name="ppo"))  # with a critic: its gradients too
    with single_process_group():
        backend = TorchBackend(cfg, torch.device("cpu"))
        models = [backend.model, backend.critic.model]
        for m in models:
            sum(p.sum() for p in m.parameters()).backward()
        assert all(p.grad is not None for m in models for p in m.parameters())
        backend.release_step_memory()
        assert all(p.grad is None for m in models for p in m.parameters())
