"""The run's config composed by Hydra outside `relax-train`: from Python (`relax_slurm.submit`,
`relax_slurm.compose_config`) and in a ready sbatch script's allocation (the Slurm driver's
`--compose`), from the same configs relax-train reads (`CONF_DIR`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from relax_slurm.config import TrainConfig, register_configs, to_train_config
from relax_slurm.config.load import check_override_keys
from relax_slurm.config.variants import check_cluster_overrides
from relax_slurm.launch.choices import check_group_choices, check_hydra_dirs

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
"""The Hydra configs: package data of an installed relax_slurm, and in a source checkout the
symlink relax_slurm/conf -> conf/ (the repository keeps them at its top). A user's own
configs are added with Hydra's --config-dir DIR (docs/configuration.md)."""


def compose_config(overrides: Sequence[str]) -> TrainConfig:
    """The TrainConfig `relax-train OVERRIDES...` would run (Hydra's compose API, no output dir)."""
    from hydra import compose, initialize_config_dir

    check_override_keys(overrides)  # an unknown or moved key named, before Hydra's advice
    check_hydra_dirs(overrides)
    check_group_choices(overrides, CONF_DIR)
    check_cluster_overrides(overrides, composed_kind)
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_train_config(compose("train", overrides=list(overrides)))


def composed_kind(overrides: Sequence[str]) -> str | None:
    """cluster.kind of the config `overrides` compose to (an experiment preset may choose the
    cluster), or None when they do not compose here (Hydra then names the problem itself)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            kind = compose("train", overrides=list(overrides)).cluster.kind
    except (HydraException, OmegaConfBaseException):  # the real compose reports it
        return None
    return kind if isinstance(kind, str) else None


def slurm_overrides(overrides: Sequence[str], default_run_dir: str | None = None) -> list[str]:
    """Overrides for a Slurm run: `cluster=slurm` unless a cluster is chosen, and `run_dir`
    unless one is given."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [*([] if "cluster" in keys else ["cluster=slurm"]), *overrides,
            *([] if "run_dir" in keys or default_run_dir is None
              else [f"run_dir={default_run_dir}"])]
