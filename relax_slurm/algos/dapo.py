"""DAPO: GRPO advantages and the PPO clip, with clip-higher and token-mean reduction (its YAML),
plus two data-side pieces the rollout applies before training:

- dynamic sampling: a group whose rewards are all equal has zero advantage everywhere and only
  dilutes the batch, so it is dropped and more prompts are sampled to refill the batch;
- soft overlong punishment: a reward penalty growing linearly over the last `buffer_len` tokens
  before the generation limit, so that length is discouraged gradually instead of a cliff at
  truncation.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from relax_slurm.algos.grpo import group_advantages, ppo_clip_token_loss
from relax_slurm.algos.registry import Algorithm, register


def is_informative_group(rewards: Sequence[float] | Tensor) -> bool:
    """True when a group's rewards are not all equal (non-zero std), i.e. it carries a signal.

    >>> is_informative_group([1.0, 0.0, 1.0]), is_informative_group([1.0, 1.0])
    (True, False)
    >>> is_informative_group([0.5])  # one sample: nothing to compare
    False
    """
    values = [float(r) for r in (rewards.flatten().tolist() if isinstance(rewards, Tensor)
                                 else rewards)]
    return len(values) >= 2 and max(values) > min(values)


def overlong_penalty(
    response_len: int, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> float:
    """Reward added to a response of `response_len` tokens when generation stops at `max_len`.

    0 up to max_len - buffer_len tokens, then falling linearly to -penalty_factor at max_len
    (and staying there beyond it). buffer_len <= 0 disables the penalty.

    >>> overlong_penalty(60, max_len=100, buffer_len=20, penalty_factor=1.0)
    0.0
    >>> overlong_penalty(90, max_len=100, buffer_len=20, penalty_factor=1.0)
    -0.5
    >>> overlong_penalty(100, max_len=100, buffer_len=20, penalty_factor=2.0)
    -2.0
    """
    if buffer_len <= 0:
        return 0.0
    excess = response_len - (max_len - buffer_len)
    if excess <= 0:
        return 0.0
    return -min(excess / buffer_len, 1.0) * penalty_factor


register(Algorithm(name="dapo", advantages=group_advantages, token_loss=ppo_clip_token_loss))
