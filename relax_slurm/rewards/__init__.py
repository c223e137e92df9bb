"""Rewards: plain callables `fn(inp: RewardInput) -> float`, looked up by name.

    score(name, response, label, metadata=None) -> float
    names() -> registered reward names (each also as boxed_<name>)
    build_reward(cfg.reward) -> the run's picklable reward (honours metadata.rm_type)
    RewardPool(max_workers, timeout_s): rewards in worker processes with a timeout
    reward_workers(cfg.reward) -> reward.num_workers resolved by the reward's declared traits

Importing this package registers the built-in rewards (`built_in.py`), one module each:
exact_match, math, dapo, deepscaler, multiple_choice and gpqa, openr1mm, geo3k, f1, ifeval,
ifbench, prefix_match, remote, genrm, dapo-genrm.
"""

from relax_slurm.rewards import built_in  # noqa: F401  (registers them)
from relax_slurm.rewards.pool import RewardPool
from relax_slurm.rewards.registry import (
    RewardError,
    RewardFn,
    RewardInput,
    Scorer,
    build_reward,
    get_reward_fn,
    names,
    register,
    register_factory,
    registered_names,
    reward_workers,
    score,
    traits,
)

__all__ = [
    "RewardError", "RewardFn", "RewardInput", "RewardPool", "Scorer", "build_reward",
    "get_reward_fn", "names", "register", "register_factory", "registered_names",
    "reward_workers", "score", "traits",
]
