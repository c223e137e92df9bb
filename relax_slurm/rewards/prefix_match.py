"""Prefix match: partial credit for how much of the label the response gets right from the start."""

from __future__ import annotations

from relax_slurm.rewards.registry import RewardInput, register


@register("prefix_match", inline=True)
def prefix_match(inp: RewardInput) -> float:
    """Common prefix of response and label / the longer of the two; 0 when truncated.

    Long answers (the long-tail task's "7*12=" -> twelve 7s) are learned a character at a time:
    a right start earns part of the reward, stopping at the right length earns the rest, and
    running past it costs as much as stopping short.

    >>> prefix_match(RewardInput(prompt="7*3=", response="777", label="777"))
    1.0
    >>> prefix_match(RewardInput(prompt="7*4=", response="77", label="7777"))
    0.5
    >>> prefix_match(RewardInput(prompt="7*2=", response="7777", label="77"))
    0.5
    >>> prefix_match(RewardInput(prompt="7*2=", response="87", label="77"))
    0.0
    >>> prefix_match(RewardInput(prompt="7*1=", response="7", label="7", finish_reason="length"))
    0.0
    """
    if inp.finish_reason != "stop":
        return 0.0
    response, label = inp.response.strip(), str(inp.label).strip()
    longest = max(len(response), len(label))
    if longest == 0:
        return 1.0
    same = 0
    for a, b in zip(response, label):
        if a != b:
            break
        same += 1
    return same / longest
