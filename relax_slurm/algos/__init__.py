"""Advantages and losses (pure torch, no I/O), by name.

    compute_advantages(name, rewards[B, G], params) -> Tensor[B, G]
    policy_loss(name, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=None,
                params=..., **loss knobs) -> (loss, metrics)

`params` is the algorithm's typed parameters (`AlgoConfig.estimator_params()`); a direct call
may give the `algo.*` fields they are built from as keywords instead.
    names() -> list of registered algorithms

The trainer calls these with `algo.name` and never branches on it.
"""

# importing a module registers its algorithms
from relax_slurm.algos import (  # noqa: F401
    cispo, dapo, grpo, gspo, opd, ppo, reinforce, rloo, sapo, sft,
)
from relax_slurm.algos.common import (
    importance_weights, kl_penalty, opsm_keep, ppo_clip, truncated_is_weights,
)
from relax_slurm.algos.dapo import is_informative_group, overlong_penalty
from relax_slurm.algos.reduce import reduce, reduction_weights
from relax_slurm.algos.registry import compute_advantages, get, names, policy_loss

__all__ = [
    "compute_advantages", "get", "importance_weights", "is_informative_group", "kl_penalty",
    "names", "opsm_keep", "overlong_penalty", "policy_loss", "ppo_clip", "reduce",
    "reduction_weights", "truncated_is_weights",
]
