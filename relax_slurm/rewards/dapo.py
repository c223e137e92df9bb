r"""DAPO's math reward: the answer on the last "Answer:" line, +1 when right, -1 otherwise.

DAPO prompts end with 'The last line of your response should be of the form Answer: $Answer'.
The answer is what follows the last "Answer:" (any case) up to the end of its line, with
`\text{}` unwrapped, a leading "x =" dropped and a trailing period removed, then graded as
the `math` reward grades (normalisation, then a symbolic check). No "Answer:" scores -1, like
a wrong answer: the format is part of the task. Only the last 300 characters are searched, so
an "Answer:" in the middle of the reasoning does not count.
"""

from __future__ import annotations

import re

from relax_slurm.rewards.math import matches_any
from relax_slurm.rewards.registry import RewardInput, register

TAIL_CHARS = 300
_ANSWER = re.compile(r"answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)
_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")


def extract_dapo_answer(response: str) -> str | None:
    r"""The answer on the last "Answer:" line of the response's tail, cleaned; None if none.

    >>> extract_dapo_answer("so...\nAnswer: $x = \\frac{3}{4}$.")
    '\\frac{3}{4}'
    >>> extract_dapo_answer("Final answer: 12 \\text{ apples}")
    '12 apples'
    >>> extract_dapo_answer("Answer: **$.5$**.")
    '.5'
    >>> extract_dapo_answer("I give up") is None
    True
    """
    found = _ANSWER.findall(response[-TAIL_CHARS:])
    if not found:
        return None
    answer = re.sub(r"\s+", " ", _TEXT.sub(r"\1", found[-1]))
    previous = None
    while answer != previous:  # peel "$...$", "**...**" and a final period in any order
        previous, answer = answer, answer.strip().strip("*$").rstrip(".")
    answer = re.sub(r"^[a-zA-Z]\s*=\s*", "", answer)  # "x = 3" -> "3"
    return answer or None


@register("dapo")
def dapo_reward(inp: RewardInput) -> float:
    r"""1.0 when the last "Answer:" line matches the label, else -1.0.

    >>> dapo_reward(RewardInput(prompt="", response="...\nAnswer: 34", label="34"))
    1.0
    >>> dapo_reward(RewardInput(prompt="", response="...\nAnswer: 35", label="34"))
    -1.0
    >>> dapo_reward(RewardInput(prompt="", response=r"it is \boxed{34}", label="34"))
    -1.0
    """
    answer = extract_dapo_answer(inp.response)
    if answer is None:
        return -1.0
    return 1.0 if matches_any(answer, inp.label) else -1.0
