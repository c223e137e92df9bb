r"""`geo3k`: the Geometry3K reward of verl / EasyR1, as Relax scores it.

    reward = 0.9 * accuracy + 0.1 * format

- accuracy: 1 when mathruler's `grade_answer` accepts the content of the response's last
  `\boxed{` (mathruler's `extract_boxed_content`: the last opening, braces balanced; a box cut
  off by truncation gives "None", which is wrong) against the label; else 0.
- format: 1 when the whole response matches `<think>.*</think>.*\boxed{.*}.*` (dot matches
  newlines), else 0. So a right answer without `<think>` scores 0.9, a wrong one in the format 0.1.

The label is the answer string, or a dict with `ground_truth` (else `answer`), as Relax reads it;
a list means any of these (best score). An empty or missing label scores 0. mathruler (PyPI,
the grader EasyR1 and verl use) does the grading itself, so the numbers are Relax's.
"""

from __future__ import annotations

import re
from typing import Any

from relax_slurm.errors import ConfigError
from relax_slurm.rewards.extract import label_list
from relax_slurm.rewards.registry import RewardInput, register

FORMAT_SCORE = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def _grader():
    try:
        from mathruler import grader
    except ImportError as e:
        raise ConfigError("the geo3k reward grades with mathruler. Fix: pip install mathruler "
                          "pylatexenc") from e
    return grader


def ground_truth(label: Any) -> str:
    """The answer in a label: the string, or a dict's `ground_truth` (else `answer`).

    >>> ground_truth({"ground_truth": "12"}), ground_truth({"answer": 3}), ground_truth(None)
    ('12', '3', '')
    """
    if label is None:
        return ""
    if isinstance(label, dict):
        return str(label.get("ground_truth") or label.get("answer", ""))
    return str(label)


def format_reward(response: str) -> float:
    r"""1.0 when the response is `<think>...</think> ... \boxed{...} ...`, else 0.0.

    >>> format_reward(r"<think>a=2</think> so \boxed{2}."), format_reward(r"\boxed{2}")
    (1.0, 0.0)
    """
    return 1.0 if _FORMAT.fullmatch(response) else 0.0


def accuracy_reward(response: str, answer: str) -> float:
    r"""1.0 when mathruler grades the last `\boxed{}` of the response equal to `answer`.

    >>> accuracy_reward(r"\boxed{\frac{1}{2}}", "0.5"), accuracy_reward(r"\boxed{3}", "4")
    (1.0, 0.0)
    """
    grader = _grader()
    return 1.0 if grader.grade_answer(grader.extract_boxed_content(response), answer) else 0.0


def geo3k_score(response: str, answer: str, format_score: float = FORMAT_SCORE) -> float:
    """(1 - format_score) * accuracy + format_score * format, the expression Relax computes."""
    return ((1.0 - format_score) * accuracy_reward(response, answer)
            + format_score * format_reward(response))


@register("geo3k")
def geo3k_reward(inp: RewardInput) -> float:
    r"""0.9 * (last `\boxed{}` equals the label per mathruler) + 0.1 * (think-then-box format).

    >>> geo3k_reward(RewardInput(prompt="", response=r"<think>x</think>\boxed{14}", label="14"))
    1.0
    >>> geo3k_reward(RewardInput(prompt="", response=r"The answer is \boxed{14}", label="14"))
    0.9
    >>> geo3k_reward(RewardInput(prompt="", response=r"<think>x</think>\boxed{13}", label="14"))
    0.1
    """
    answers = [a for a in (ground_truth(g) for g in label_list(inp.label)) if a]
    if not answers:
        return 0.0
    return max(geo3k_score(inp.response, a) for a in answers)
