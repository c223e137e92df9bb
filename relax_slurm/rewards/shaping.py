"""DAPO's two data-side pieces, applied by the rollout worker before a group reaches the broker
(pure, torch-free: the worker never imports torch):

- dynamic sampling: a group whose rewards are all equal has zero advantage everywhere and only
  dilutes the batch, so it is dropped and more prompts are sampled to refill the batch;
- soft overlong punishment: a reward penalty growing linearly over the last `buffer_len` tokens
  before the generation limit, so that length is discouraged gradually instead of a cliff at
  truncation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def is_informative_group(rewards: Sequence[float] | Any) -> bool:
    """True when a group's rewards are not all equal (non-zero std), i.e. it carries a signal.

    >>> is_informative_group([1.0, 0.0, 1.0]), is_informative_group([1.0, 1.0])
    (True, False)
    >>> is_informative_group([0.5])  # one sample: nothing to compare
    False
    """
    if hasattr(rewards, "flatten"):  # a tensor or an array
        rewards = rewards.flatten().tolist()
    values = [float(r) for r in rewards]
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
