"""Rewards by name: `@register("name")` on a function, `get_reward_fn(name)` to look it up.

A reward is a plain callable `fn(inp: RewardInput) -> float`: strings in, a number out, no I/O.
`reward.name` is a registered name or a dotted path `package.module:function` to your own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax_slurm.errors import ConfigError


@dataclass(kw_only=True)
class RewardInput:
    """Everything a reward sees about one response."""

    prompt: str
    """The rendered prompt text."""
    response: str
    """The decoded response, special tokens skipped."""
    label: Any
    """The reference answer from the dataset row (`data.label_key`)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's metadata (`data.metadata_key`), or empty."""
    finish_reason: str = "stop"
    """'stop' when the model ended with EOS or a stop string, 'length' when truncated."""


RewardFn = Callable[[RewardInput], float]

_REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward under `name`; names are unique."""

    def add(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered by {_REGISTRY[name]!r}")
        _REGISTRY[name] = fn
        return fn

    return add


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_fn(name: str) -> RewardFn:
    """The reward registered as `name`, or the function at dotted path `package.module:function`.

    >>> reward = get_reward_fn("exact_match")
    >>> reward(RewardInput(prompt="3+4=", response="7", label="7", finish_reason="stop"))
    1.0
    """
    if ":" in name:
        return _import_reward(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"reward.name={name!r} is not a registered reward. Fix: use one of "
            f"{registered_names()}, or a dotted path reward.name=package.module:function"
        ) from None


def _import_reward(path: str) -> RewardFn:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"reward.name={path!r}: cannot import module {module_name!r} ({e}). Fix: make it "
            "importable (installed, or on PYTHONPATH) or use a registered reward: "
            f"{registered_names()}"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(
            f"reward.name={path!r}: module {module_name!r} has no function {attr!r}. Fix: "
            "give reward.name=package.module:function with fn(inp: RewardInput) -> float"
        )
    return fn
