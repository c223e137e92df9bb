"""Typed configs (dataclasses registered with Hydra) and the one way every process reads them."""

from relax_slurm.config.load import load_config, register_configs, save_config, to_train_config
from relax_slurm.config.schema import TrainConfig

__all__ = ["TrainConfig", "load_config", "register_configs", "save_config", "to_train_config"]
