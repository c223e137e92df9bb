"""The table of environments by name, and `@register_env("name")` that fills it: the one module
a built-in environment (envs/tools.py, envs/arith_feedback.py) or a user's imports to register,
so that the registry (envs/registry.py), which loads the built-ins, is not imported back."""

from __future__ import annotations

from typing import Callable

from relax_slurm.envs.base import BaseEnv

EnvFactory = Callable[..., BaseEnv]
_TABLE: dict[str, EnvFactory] = {}


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator adding an environment class or factory under `name`."""

    def add(factory: EnvFactory) -> EnvFactory:
        if name in _TABLE and _TABLE[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered by {_TABLE[name]!r}")
        _TABLE[name] = factory
        return factory

    return add


def registered(name: str) -> EnvFactory | None:
    """The factory registered under `name`, None if there is none."""
    return _TABLE.get(name)


def registered_names() -> list[str]:
    return sorted(_TABLE)
