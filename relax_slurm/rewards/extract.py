r"""Shared answer extraction: the last `\boxed{}`, the text after `</think>`, label lists.

Linear in the length of the text, so a very long (or adversarial) response costs milliseconds.
"""

from __future__ import annotations

import re
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_THINK_END = "</think>"


def last_boxed(text: str) -> str | None:
    r"""The content of the last complete `\boxed{...}`, nested braces allowed; None if none.

    "Last" is the box that opens last among those that close, so a nested box wins over its
    enclosing one and a box cut off by truncation is skipped.

    >>> last_boxed(r"so \boxed{1} or rather \boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
    >>> last_boxed(r"\boxed{3} then cut off \boxed{\frac{1")
    '3'
    >>> last_boxed("no box") is None
    True
    """
    # brace position -> start of that box's content
    box_opens = {m.end() - 1: m.end() for m in _BOXED.finditer(text)}
    if not box_opens:
        return None
    stack: list[int] = []
    best: tuple[int, int] | None = None  # (content start, content end) of the latest box
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            opened = stack.pop()
            start = box_opens.get(opened)
            if start is not None and (best is None or start > best[0]):
                best = (start, m.start())
    return None if best is None else text[best[0]:best[1]]


def after_think(text: str) -> str | None:
    """The text after the last `</think>`, or None when the response has no `</think>`.

    >>> after_think("<think>hmm</think> It is 4.")
    ' It is 4.'
    >>> after_think("It is 4.") is None
    True
    """
    i = text.rfind(_THINK_END)
    return None if i < 0 else text[i + len(_THINK_END):]


def final_text(text: str) -> str:
    """The text after the last `</think>` if there is one, else all of it."""
    tail = after_think(text)
    return text if tail is None else tail


def label_list(label: Any) -> list[Any]:
    """A label as a list of acceptable answers (datasets store one answer or a list).

    >>> label_list("4"), label_list(["4", "four"]), label_list(None)
    (['4'], ['4', 'four'], [])
    """
    if label is None:
        return []
    if isinstance(label, (list, tuple)):
        return list(label)
    return [label]


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def answer_tag(text: str) -> str | None:
    """The stripped content of the last complete `<answer>...</answer>`, or None.

    >>> answer_tag("<think>2+2</think><answer> 4 </answer>")
    '4'
    >>> answer_tag("<answer>4") is None
    True
    """
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None
