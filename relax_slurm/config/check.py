"""The two helpers every config section uses: `check` refuses a value with a message that
names the override fixing it, `default_of` reads a field's default where it is written."""

from __future__ import annotations

from typing import Any

from relax_slurm.errors import ConfigError


def check(cond: bool, msg: str) -> None:
    """ConfigError(msg) unless cond."""
    if not cond:
        raise ConfigError(msg)


def default_of(cls: type, name: str) -> Any:
    """A config field's default: the one place it is written (the media processor's limits
    and the hf engine's flags of the same name read theirs from here)."""
    return cls.__dataclass_fields__[name].default
