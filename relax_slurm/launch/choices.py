"""Command-line overrides relax-train checks before Hydra sees them: a group's choice
(`experiment=NAME`, `algo=NAME`) must name one of the group's presets, and Hydra's output
directories are not a user's to set (`run_dir` is the run's directory).

Hydra's own error for a misspelt choice lists its search path and the internal `base_<group>`
schemas, with no suggestion; these errors name the presets and the closest one."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Sequence

from relax_slurm.config.load import sweep_items
from relax_slurm.errors import ConfigError

INTERNAL_PREFIX = "base_"  # ConfigStore schemas every group's YAML extends, never a choice
# Hydra's output directories are derived from run_dir (conf/train.yaml): set there, one would
# be ignored (the run would still go to run_dir, the other directory get only .hydra/)
HYDRA_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir")


def group_options(conf_dir: Path, group: str) -> list[str]:
    """The presets of a config group: conf/<group>/*.yaml, without the internal schemas."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml")
                  if not p.stem.startswith(INTERNAL_PREFIX))


def check_hydra_dirs(overrides: Sequence[str]) -> None:
    """ConfigError for hydra.run.dir=/hydra.sweep.dir=, naming run_dir= as the fix."""
    for arg in overrides:
        key, _, value = arg.lstrip("+~").partition("=")
        if key in HYDRA_DIR_KEYS:
            raise ConfigError(f"{arg!r}: relax-train sets {key} from run_dir, so it would be "
                              f"ignored; write run_dir={value} instead")


def check_group_choices(overrides: Sequence[str], conf_dir: Path) -> None:
    """ConfigError for `group=NAME` where NAME is none of the group's presets ("did you mean")."""
    for arg in overrides:
        if arg.startswith(("-", "~")) or "=" not in arg:
            continue
        group, value = arg.lstrip("+").split("=", 1)
        if "." in group or "/" in group or not (conf_dir / group).is_dir():
            continue
        options = group_options(conf_dir, group)
        for name in sweep_items(value):  # a sweep's a,b,c checks each; Hydra's functions none
            if (name in options or name == "null" or "${" in name
                    or (conf_dir / group / f"{name}.yaml").is_file()):  # a nested sub/name
                continue
            near = closest(name, options)
            hint = f"; did you mean {near}?" if near else ""
            raise ConfigError(f"{group}={name}: no such {group}{hint} "
                              f"(options: {', '.join(options)})")


def closest(name: str, options: list[str]) -> str | None:
    """The option `name` most likely misspells: difflib's closest, where a swap of two letters
    (gpro -> grpo) wins over a tie with a changed letter (gspo)."""
    near = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
    swapped = [o for o in near if sorted(o) == sorted(name)]
    return (swapped or near or [None])[0]
