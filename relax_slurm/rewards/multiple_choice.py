r"""Multiple-choice answers graded by option letter: `multiple_choice` (lenient) and `gpqa`.

The label is an option letter (`"B"`, `"(b)"`), or an option's text when
`metadata["choices"]` lists the options in order (`A` is the first). Text after `</think>` is
read when there is one.

- `multiple_choice` takes, in order: the last `<answer>X</answer>` (AVQA-style; its content may
  also be an option's text); the last `\boxed{X}`; the last "answer is X" /
  "Answer: X" (with `(X)`, `$X$`, `**X**` accepted); a response that is only the letter; the
  last standalone `(X)`. Letters run A-Z (or as many as `metadata["choices"]`).
- `gpqa` is strict, as GPQA evaluations are: only "Answer: X" with X in A-D (or the number of
  choices), or the last `\boxed{X}`.
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


@register("gpqa")
def gpqa_reward(inp: RewardInput) -> float:
    r"""1.0 iff the last "Answer: X" (or last `\boxed{X}`) is the label's letter, X in A-D.

    >>> gpqa_reward(RewardInput(prompt="", response="...so\nAnswer: C", label="C"))
    1.0
    >>> gpqa_reward(RewardInput(prompt="", response="I pick (C)", label="C"))
    0.0
    >>> gpqa_reward(RewardInput(prompt="", response="Answer: E", label="E"))
    0.0
    """
    metadata = inp.metadata or {}
    letters = _letters(metadata, 4)
    text = final_text(inp.response)
    picked = _last_match(r"answer\s*:" + _WRAPPED + r"(?![A-Za-z])", text, letters)
    if picked is None:
        picked = _boxed_letter(text, letters)
    gold = label_letter(inp.label, metadata)
    return 1.0 if gold is not None and picked == gold else 0.0
