r"""Math answers: the last `\boxed{...}` of the response (else its last number) against the label.

Grading is in two steps. First a cheap normalisation catches simple equivalent forms: spaces
and `$` removed, `\dfrac`/`\tfrac` read as `\frac`, `\left`/`\right` dropped, thousands commas
removed from numbers (`1,000` -> `1000`), a trailing `.0` dropped (`7.0` -> `7`), and two plain
numbers compared by value (`0.50` == `.5`). When that fails, both sides are parsed with
math-verify (LaTeX or plain expressions into SymPy) and compared symbolically, so `1/2` equals
`0.5` and `\frac{\sqrt{2}}{2}` equals `\frac{1}{\sqrt{2}}`. A label may be a list of
acceptable answers. `finish_reason` is not checked: a truncated response whose last `\boxed{}`
is complete scores.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from relax_slurm.errors import ConfigError
from relax_slurm.rewards.extract import label_list, last_boxed
from relax_slurm.rewards.registry import RewardInput, register

__all__ = ["answers_match", "extract_answer", "last_boxed", "math_reward", "normalize"]

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_COMMA_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TRAILING_ZERO = re.compile(r"(-?\d+)\.0+")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
# math-verify bounds its own parsing and comparison time with SIGALRM, which only works in a
# process's main thread; elsewhere the caller (the reward pool) must bound the time.
_SYMBOLIC_TIMEOUT_S = 5
# beyond this length an "answer" is prose, not a formula: skip the symbolic parse
_MAX_SYMBOLIC_CHARS = 1000


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


def _unbox(answer: Any) -> str:
    s = str(answer)
    boxed = last_boxed(s)  # labels are sometimes boxed too
    return s if boxed is None else boxed


def normalize(answer: Any) -> str:
    r"""A canonical string for simple equivalent forms of an answer.

    >>> normalize(" $1,000.0$ ")
    '1000'
    >>> normalize(r"\dfrac{1}{2}")
    '\\frac{1}{2}'
    """
    s = re.sub(r"\s+", "", _unbox(answer)).replace("$", "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = s.replace(r"\left", "").replace(r"\right", "")
    if _COMMA_NUMBER.fullmatch(s):
        s = s.replace(",", "")
    m = _TRAILING_ZERO.fullmatch(s)
    if m:
        s = m.group(1)
    return s


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ConfigError(
            "the math reward's symbolic check needs math-verify. Fix: "
            "pip install math-verify 'antlr4-python3-runtime==4.9.*' (the antlr4 runtime Hydra "
            "also uses)"
        ) from e
    return math_verify


def warm_up() -> None:
    """Import math-verify and SymPy's parsers now (seconds), not inside the first timed call."""
    try:
        symbolic_equal("1/2", "0.5")
        symbolic_equal(r"x = \frac{\sqrt{2}}{2}", r"\{1, \pi\}")
    except ConfigError:  # math-verify missing: the first math reward reports it
        pass


def symbolic_equal(predicted: Any, label: Any) -> bool:
    r"""Whether math-verify finds the two answers mathematically equal.

    >>> symbolic_equal("1/2", "0.5"), symbolic_equal(r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}")
    (True, True)
    >>> symbolic_equal("3", "4")
    False
    """
    a, b = _unbox(predicted).strip().strip("$"), _unbox(label).strip().strip("$")
    if not a or not b or max(len(a), len(b)) > _MAX_SYMBOLIC_CHARS:
        return False
    mv = _math_verify()
    timeout = _SYMBOLIC_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(f"${b}$", parsing_timeout=timeout)
    pred = mv.parse(f"${a}$", parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=timeout))


def answers_match(predicted: Any, label: Any, symbolic: bool = True) -> bool:
    """Whether two answers are equal after `normalize`, by value, or (symbolic) per math-verify."""
    a, b = normalize(predicted), normalize(label)
    if a == b:
        return True
    if _PLAIN_NUMBER.fullmatch(a) and _PLAIN_NUMBER.fullmatch(b):
        return float(a) == float(b)
    return symbolic and symbolic_equal(predicted, label)


def matches_any(predicted: Any, label: Any) -> bool:
    """`answers_match` against any of the label's acceptable answers."""
    return any(answers_match(predicted, gold) for gold in label_list(label))


@register("math")
def math_reward(inp: RewardInput) -> float:
    r"""1.0 iff the response's answer (last `\boxed{}`, else last number) matches the label.

    >>> math_reward(RewardInput(prompt="", response=r"\boxed{\dfrac{1}{2}}", label=r"\frac{1}{2}"))
    1.0
    >>> math_reward(RewardInput(prompt="", response="The total is $1,200.", label="1200"))
    1.0
    >>> math_reward(RewardInput(prompt="", response=r"\boxed{7.0}", label=7))
    1.0
    >>> math_reward(RewardInput(prompt="", response=r"\boxed{1/2}", label="0.5"))
    1.0
    >>> math_reward(RewardInput(prompt="", response=r"\boxed{8}", label="7"))
    0.0
    >>> math_reward(RewardInput(prompt="", response="I am not sure.", label="7"))
    0.0
    """
    predicted = extract_answer(inp.response)
    if predicted is None:
        return 0.0
    return 1.0 if matches_any(predicted, inp.label) else 0.0
