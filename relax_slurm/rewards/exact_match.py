"""Exact match: the whole response, stripped, equals the label, and the model stopped itself."""

from __future__ import annotations

from relax_slurm.rewards.registry import RewardInput, register


@register("exact_match", inline=True)
def exact_match(inp: RewardInput) -> float:
    """1.0 iff the response ended with EOS (finish_reason 'stop') and equals the label.

    A truncated response scores 0 even when its text matches: on the tiny task the model must
    learn to stop after the digit.

    >>> exact_match(RewardInput(prompt="3+4=", response="7", label="7", finish_reason="stop"))
    1.0
    >>> exact_match(RewardInput(prompt="3+4=", response=" 7 ", label=7))
    1.0
    >>> exact_match(RewardInput(prompt="3+4=", response="7", label="7", finish_reason="length"))
    0.0
    >>> exact_match(RewardInput(prompt="3+4=", response="8", label="7"))
    0.0
    """
    if inp.finish_reason != "stop":
        return 0.0
    return 1.0 if inp.response.strip() == str(inp.label).strip() else 0.0
