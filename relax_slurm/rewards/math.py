r"""Math answers: the last `\boxed{...}` of the response (else its last number) against the label.

Both sides are normalised for simple equivalent forms before comparing: spaces and `$` removed,
`\dfrac`/`\tfrac` read as `\frac`, `\left`/`\right` dropped, thousands commas removed from
numbers (`1,000` -> `1000`), a trailing `.0` dropped (`7.0` -> `7`), and two plain numbers
compared by value (`0.50` == `.5`). No symbolic algebra: `1/2` and `0.5` differ.
`finish_reason` is not checked: a truncated response whose last `\boxed{}` is complete scores.
"""

from __future__ import annotations

import re
from typing import Any

from relax_slurm.rewards.registry import RewardInput, register

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_COMMA_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TRAILING_ZERO = re.compile(r"(-?\d+)\.0+")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


def last_boxed(text: str) -> str | None:
    r"""The content of the last complete `\boxed{...}`, nested braces allowed; None if none.

    >>> last_boxed(r"so \boxed{1} or rather \boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
    >>> last_boxed(r"\boxed{3} then cut off \boxed{\frac{1")
    '3'
    >>> last_boxed("no box") is None
    True
    """
    found = None
    for m in _BOXED.finditer(text):
        depth = 1
        for j in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                found = text[m.end():j]
                break
    return found


def extract_answer(text: str) -> str | None:
    r"""The last `\boxed{}` content, else the last number in `text`, else None.

    >>> extract_answer(r"2+2 is \boxed{4}.")
    '4'
    >>> extract_answer("We get 1,234 apples, then 12.")
    '12'
    >>> extract_answer("no answer") is None
    True
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize(answer: Any) -> str:
    r"""A canonical string for simple equivalent forms of an answer.

    >>> normalize(" $1,000.0$ ")
    '1000'
    >>> normalize(r"\dfrac{1}{2}")
    '\\frac{1}{2}'
    """
    s = str(answer)
    boxed = last_boxed(s)  # labels are sometimes boxed too
    if boxed is not None:
        s = boxed
    s = re.sub(r"\s+", "", s).replace("$", "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = s.replace(r"\left", "").replace(r"\right", "")
    if _COMMA_NUMBER.fullmatch(s):
        s = s.replace(",", "")
    m = _TRAILING_ZERO.fullmatch(s)
    if m:
        s = m.group(1)
    return s


def answers_match(predicted: Any, label: Any) -> bool:
    """Whether two answers are equal after `normalize` (plain numbers compared by value)."""
    a, b = normalize(predicted), normalize(label)
    if a == b:
        return True
    if _PLAIN_NUMBER.fullmatch(a) and _PLAIN_NUMBER.fullmatch(b):
        return float(a) == float(b)
    return False


@register("math")
def math_reward(inp: RewardInput) -> float:
    r"""1.0 iff the response's answer (last `\boxed{}`, else last number) matches the label.

    >>> math_reward(RewardInput(prompt="", response=r"\boxed{\dfrac{1}{2}}", label=r"\frac{1}{2}"))
    1.0
    >>> math_reward(RewardInput(prompt="", response="The total is $1,200.", label="1200"))
    1.0
    >>> math_reward(RewardInput(prompt="", response=r"\boxed{7.0}", label=7))
    1.0
    >>> math_reward(RewardInput(prompt="", response=r"\boxed{8}", label="7"))
    0.0
    >>> math_reward(RewardInput(prompt="", response="I am not sure.", label="7"))
    0.0
    """
    predicted = extract_answer(inp.response)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, inp.label) else 0.0
