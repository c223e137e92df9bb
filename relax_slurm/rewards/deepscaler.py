r"""DeepScaleR's reward: the last `\boxed{}` after `</think>`, 1 when it matches the label, else 0.

The response must close its reasoning with `</think>`; only what follows counts, so a box
inside the reasoning does not. Graded as the `math` reward grades; a label may be a list.
"""

from __future__ import annotations

from relax_slurm.rewards.extract import after_think, last_boxed
from relax_slurm.rewards.math import matches_any
from relax_slurm.rewards.registry import RewardInput, register


@register("deepscaler")
def deepscaler_reward(inp: RewardInput) -> float:
    r"""1.0 iff there is a `</think>` and the last box after it matches the label.

    >>> def grade(response):
    ...     return deepscaler_reward(RewardInput(prompt="", response=response, label="12"))
    >>> grade(r"<think>..</think> \boxed{12}"), grade(r"\boxed{12}")
    (1.0, 0.0)
    >>> grade(r"<think>\boxed{12}</think> 12")  # a box inside the reasoning does not count
    0.0
    """
    answer_part = after_think(inp.response)
    if answer_part is None:
        return 0.0
    answer = last_boxed(answer_part)
    if answer is None:
        return 0.0
    return 1.0 if matches_any(answer, inp.label) else 0.0
