"""Import an optional package, or fail with the config key that asked for it and the fix."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from relax_slurm.errors import ConfigError


def _missing(config_key: str, pip_name: str) -> ConfigError:
    return ConfigError(
        f"{config_key} needs the optional package {pip_name!r}, which is not installed: "
        f"`pip install {pip_name}` (or `pip install relax-slurm[observability]`), "
        f"or turn {config_key} off"
    )


def require(module: str, config_key: str, pip_name: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _missing(config_key, pip_name) from e


def check_available(module: str, config_key: str, pip_name: str) -> None:
    """`require` without the import: the launcher checks, only the trainer pays the import."""
    if importlib.util.find_spec(module) is None:
        raise _missing(config_key, pip_name)
