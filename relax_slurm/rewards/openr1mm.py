r"""`openr1mm`: the accuracy reward of multimodal-open-r1 style data (answers in `<answer>` tags).

The response's answer is the content of its last `<answer>...</answer>` (the whole final text
when it has none); the label's likewise (datasets such as multimodal-open-r1-8k-verified store
the solution as `<answer> 3 </answer>`). First math-verify decides (symbolic equality, so
`\frac{1}{2}` matches `0.5`); when it cannot parse either side, or says no, the normalised
strings are compared exactly (so a text answer such as "cat" matches "Cat."). As Relax's: a
response with more than one `</think>` or more than one `<answer>` scores 0 (a model that
learns to hedge with several answers must not be paid for the last one).
"""

from __future__ import annotations

import re
from typing import Any

from relax_slurm.rewards.extract import answer_tag, final_text, label_list
from relax_slurm.rewards.math import answers_match
from relax_slurm.rewards.registry import RewardInput, register


def _text_norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().strip("$").rstrip(".").strip()).lower()


def _answer(text: str) -> str:
    tagged = answer_tag(text)
    return tagged if tagged is not None else final_text(text).strip()


def answer_matches(predicted: str, gold: Any) -> bool:
    """math-verify equality, then exact match of the normalised strings."""
    gold_text = _answer(str(gold))
    if not predicted or not gold_text:
        return False
    try:
        if answers_match(predicted, gold_text):
            return True
    except Exception:  # math-verify failing on odd input is a "no", not an error
        pass
    return _text_norm(predicted) == _text_norm(gold_text)


@register("openr1mm")
def openr1mm_reward(inp: RewardInput) -> float:
    r"""1.0 iff the response's `<answer>` equals the label (math-verify, then exact match).

    >>> openr1mm_reward(RewardInput(
    ...     prompt="", response="<think>..</think><answer>\\frac{1}{2}</answer>",
    ...     label="<answer> 0.5 </answer>"))
    1.0
    >>> openr1mm_reward(RewardInput(prompt="", response="<answer>Cat.</answer>", label="cat"))
    1.0
    >>> openr1mm_reward(RewardInput(prompt="", response="<answer>3</answer>", label="4"))
    0.0
    >>> openr1mm_reward(RewardInput(prompt="", response="7", label="7"))
    1.0
    >>> openr1mm_reward(RewardInput(prompt="", response="<answer>3</answer><answer>4</answer>",
    ...     label="4"))
    0.0
    >>> openr1mm_reward(RewardInput(prompt="", response="a</think>b</think><answer>4</answer>",
    ...     label="4"))
    0.0
    """
    if inp.response.count("</think>") > 1 or inp.response.count("<answer>") > 1:
        return 0.0
    predicted = _answer(inp.response)
    return 1.0 if any(answer_matches(predicted, g) for g in label_list(inp.label)) else 0.0
