r"""Multiple-choice answers graded by option letter: `multiple_choice` (lenient) and `gpqa`.

The label is an option letter (`"B"`, `"(b)"`), or an option's text when
`metadata["choices"]` lists the options in order (`A` is the first). Text after `</think>` is
read when there is one.

- `multiple_choice` takes, in order: the last `<answer>X</answer>` (AVQA-style; its content may
  also be an option's text); the last `\boxed{X}`; the last "answer is X" /
  "Answer: X" (with `(X)`, `$X$`, `**X**` accepted); a response that is only the letter; the
  last standalone `(X)`. Letters run A-Z (or as many as `metadata["choices"]`).
- `gpqa` scores as Relax's does (a Relax recipe keeps its numbers): lenient, it takes what
  `multiple_choice` takes ("the answer is (C)", "Answer: C", `\boxed{C}`, ...) and falls back to
  the last standalone capital letter among the valid ones. Valid letters: `metadata
  ["valid_letters"]` (a string or list), else one per `metadata["choices"]`, else A-D. The gold
  letter: `metadata["correct_letter"]` when present, else the label as a letter, an index
  (0-based, int or digits) or an option's text.
- `gpqa_strict`, as GPQA evaluations grade: only "Answer: X" with X a valid letter, or the last
  `\boxed{X}`.
"""

from __future__ import annotations

import re
import string
from typing import Any

from relax_slurm.rewards.extract import answer_tag, final_text, last_boxed
from relax_slurm.rewards.registry import RewardInput, register

_ANSWER_IS = r"(?:answer\s+is|answer\s*:|answer\s+is\s*:)"
_WRAPPED = r"[\s(\[*$]*([A-Za-z])[\s)\]*$]*"


def _letters(metadata: dict[str, Any], default: int) -> str:
    choices = metadata.get("choices")
    n = len(choices) if isinstance(choices, (list, tuple)) and choices else default
    return string.ascii_uppercase[:n]


def label_letter(label: Any, metadata: dict[str, Any]) -> str | None:
    """The label's option letter: a letter as such, or the position of the label in `choices`."""
    text = str(label).strip()
    m = re.fullmatch(r"[\s(\[]*([A-Za-z])[\s)\].:]*", text)
    if m:
        return m.group(1).upper()
    choices = metadata.get("choices") or []
    for i, choice in enumerate(choices):
        if str(choice).strip().lower() == text.lower() and i < 26:
            return string.ascii_uppercase[i]
    return None


def _boxed_letter(text: str, letters: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is None:
        return None
    m = re.fullmatch(r"[\s(]*(?:\\text\{)?\s*([A-Za-z])\s*\}?[\s)]*", boxed)
    return m.group(1).upper() if m and m.group(1).upper() in letters else None


def _last_match(pattern: str, text: str, letters: str) -> str | None:
    found = [g.upper() for g in re.findall(pattern, text, re.IGNORECASE) if g.upper() in letters]
    return found[-1] if found else None


def choose_letter(response: str, letters: str) -> str | None:
    """The option letter a response picks (see the module doc); None if it picks none.

    >>> choose_letter("The answer is (c).", "ABCD"), choose_letter(" B ", "ABCD")
    ('C', 'B')
    >>> choose_letter("Options (A) and (B) look fine but (D) wins", "ABCD")
    'D'
    >>> choose_letter("no idea", "ABCD") is None
    True
    """
    text = final_text(response)
    tagged = answer_tag(text)
    if tagged is not None:
        m = re.fullmatch(r"[\s(*$]*([A-Za-z])[\s).*$]*", tagged)
        if m and m.group(1).upper() in letters:
            return m.group(1).upper()
    found = _boxed_letter(text, letters)
    if found is None:
        found = _last_match(_ANSWER_IS + _WRAPPED + r"(?![A-Za-z])", text, letters)
    if found is None:
        m = re.fullmatch(r"[\s(*$]*([A-Za-z])[\s).*$]*", text)
        found = m.group(1).upper() if m and m.group(1).upper() in letters else None
    if found is None:
        found = _last_match(r"\(([A-Za-z])\)", text, letters)
    return found


@register("multiple_choice")
def multiple_choice_reward(inp: RewardInput) -> float:
    """1.0 iff the letter the response picks is the label's letter.

    >>> multiple_choice_reward(RewardInput(prompt="", response="Answer: (B)", label="B"))
    1.0
    >>> multiple_choice_reward(RewardInput(prompt="", response="the answer is Paris",
    ...     label="Paris", metadata={"choices": ["Rome", "Paris"]}))
    0.0
    >>> multiple_choice_reward(RewardInput(prompt="", response="<answer>C</answer>", label="C"))
    1.0
    >>> multiple_choice_reward(RewardInput(prompt="", response="<think>hm</think><answer>paris"
    ...     "</answer>", label="B", metadata={"choices": ["Rome", "Paris"]}))
    1.0
    >>> multiple_choice_reward(RewardInput(prompt="", response=r"\\boxed{B}",
    ...     label="Paris", metadata={"choices": ["Rome", "Paris"]}))
    1.0
    """
    metadata = inp.metadata or {}
    gold = label_letter(inp.label, metadata)
    picked = choose_letter(inp.response, _letters(metadata, 26))
    if picked is None:  # <answer>option text</answer>, as AVQA-style responses often give
        tagged = answer_tag(final_text(inp.response))
        picked = label_letter(tagged, metadata) if tagged else None
    return 1.0 if gold is not None and picked == gold else 0.0


def _valid_letters(metadata: dict[str, Any]) -> str:
    given = metadata.get("valid_letters")
    if given:
        return "".join(str(x).strip().upper() for x in given)
    return _letters(metadata, 4)


def gpqa_gold(label: Any, metadata: dict[str, Any], letters: str) -> str | None:
    """The gold letter: metadata["correct_letter"], else the label as a letter, a 0-based index
    or an option's text."""
    if metadata.get("correct_letter"):
        return str(metadata["correct_letter"]).strip().strip("()").upper() or None
    if isinstance(label, int) and not isinstance(label, bool) or str(label).strip().isdigit():
        i = int(str(label).strip())
        return letters[i] if 0 <= i < len(letters) else None
    return label_letter(label, metadata)


@register("gpqa")
def gpqa_reward(inp: RewardInput) -> float:
    r"""1.0 iff the letter the response picks is the gold one (lenient, as Relax's).

    >>> gpqa_reward(RewardInput(prompt="", response="so the answer is (c).", label="C"))
    1.0
    >>> gpqa_reward(RewardInput(prompt="", response="B looks wrong; I go with D", label=3))
    1.0
    >>> gpqa_reward(RewardInput(prompt="", response="Answer: E", label="E"))
    0.0
    >>> gpqa_reward(RewardInput(prompt="", response="Answer: E", label="x",
    ...     metadata={"valid_letters": "ABCDE", "correct_letter": "E"}))
    1.0
    """
    metadata = inp.metadata or {}
    letters = _valid_letters(metadata)
    gold = gpqa_gold(inp.label, metadata, letters)
    text = final_text(inp.response)
    picked = choose_letter(inp.response, letters)
    if picked is None:  # the last standalone capital letter among the valid ones
        found = [c for c in re.findall(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])", text) if c in letters]
        picked = found[-1] if found else None
    return 1.0 if gold is not None and picked == gold else 0.0


@register("gpqa_strict")
def gpqa_strict_reward(inp: RewardInput) -> float:
    r"""1.0 iff the last "Answer: X" (or last `\boxed{X}`) is the label's letter, X valid.

    >>> gpqa_strict_reward(RewardInput(prompt="", response="...so\nAnswer: C", label="C"))
    1.0
    >>> gpqa_strict_reward(RewardInput(prompt="", response="I pick (C)", label="C"))
    0.0
    >>> gpqa_strict_reward(RewardInput(prompt="", response="Answer: E", label="E"))
    0.0
    """
    metadata = inp.metadata or {}
    letters = _valid_letters(metadata)
    text = final_text(inp.response)
    picked = _last_match(r"answer\s*:" + _WRAPPED + r"(?![A-Za-z])", text, letters)
    if picked is None:
        picked = _boxed_letter(text, letters)
    gold = gpqa_gold(inp.label, metadata, letters)
    return 1.0 if gold is not None and picked == gold else 0.0
