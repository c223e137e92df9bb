"""Rewards: plain callables `fn(inp: RewardInput) -> float`, looked up by name.

Importing this package registers the built-in rewards: `exact_match` (exact_match.py) and
`math` (math.py). Get one with `get_reward_fn(cfg.reward.name)`.
"""

from relax_slurm.rewards import exact_match, math  # noqa: F401  (importing registers them)
from relax_slurm.rewards.registry import (
    RewardFn,
    RewardInput,
    get_reward_fn,
    register,
    registered_names,
)

__all__ = ["RewardFn", "RewardInput", "get_reward_fn", "register", "registered_names"]
