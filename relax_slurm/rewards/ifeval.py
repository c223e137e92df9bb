"""IFEval-style verifiable instructions, checked from the sample's metadata.

Metadata follows the IFEval dataset: `instruction_id_list` (e.g. `["punctuation:no_comma",
"length_constraints:number_words"]`) and `kwargs`, one dict per instruction (`None` values are
ignored). The reward is the fraction of instructions followed (partial credit helps RL more
than IFEval's all-or-nothing prompt-level score). An instruction id outside the supported
subset (`SUPPORTED`) raises, so the sample is counted as a reward error rather than silently
graded on part of its instructions. Relations are IFEval's "less than" / "at least". Text
after `</think>` is checked when there is one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from relax_slurm.rewards.extract import final_text
from relax_slurm.rewards.registry import RewardInput, register

Check = Callable[..., bool]


def _compare(count: int, n: int, relation: str = "at least") -> bool:
    if relation == "less than":
        return count < n
    if relation == "at least":
        return count >= n
    raise ValueError(f"ifeval: unknown relation {relation!r}; use 'less than' or 'at least'")


def _words(text: str) -> list[str]:
    return re.findall(r"\w+(?:['’-]\w+)*", text)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if re.search(r"\w", s)]


def _existence(text: str, keywords: list[str], **_: Any) -> bool:
    return all(re.search(re.escape(k), text, re.IGNORECASE) for k in keywords)


def _forbidden(text: str, forbidden_words: list[str], **_: Any) -> bool:
    return not any(re.search(rf"\b{re.escape(w)}\b", text, re.IGNORECASE)
                   for w in forbidden_words)


def _frequency(text: str, keyword: str, frequency: int, relation: str = "at least",
               **_: Any) -> bool:
    return _compare(len(re.findall(re.escape(keyword), text, re.IGNORECASE)), frequency, relation)


def _letter_frequency(text: str, letter: str, let_frequency: int,
                      let_relation: str = "at least", **_: Any) -> bool:
    return _compare(text.lower().count(letter.lower()), let_frequency, let_relation)


def _number_words(text: str, num_words: int, relation: str = "at least", **_: Any) -> bool:
    return _compare(len(_words(text)), num_words, relation)


def _number_sentences(text: str, num_sentences: int, relation: str = "at least",
                      **_: Any) -> bool:
    return _compare(len(_sentences(text)), num_sentences, relation)


def _number_paragraphs(text: str, num_paragraphs: int, **_: Any) -> bool:
    parts = re.split(r"\s?\*\*\*\s?", text.strip())
    return len(parts) == num_paragraphs and all(p.strip() for p in parts)


def _bullets(text: str, num_bullets: int, **_: Any) -> bool:
    return len(re.findall(r"^\s*[*-]\s+\S", text, re.MULTILINE)) == num_bullets


def _highlights(text: str, num_highlights: int, **_: Any) -> bool:
    found = re.findall(r"\*\*[^\n*]+\*\*|\*[^\n*]+\*", text)
    return len([h for h in found if h.strip("*").strip()]) >= num_highlights


def _sections(text: str, section_spliter: str, num_sections: int, **_: Any) -> bool:
    parts = re.split(rf"\s?{re.escape(section_spliter)}\s?\d+\s?", text)
    return len(parts) - 1 >= num_sections


def _json(text: str, **_: Any) -> bool:
    body = re.sub(r"^```(?:json)?\s*|\s*```$", "", text.strip(), flags=re.IGNORECASE)
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _capital_words(text: str, capital_frequency: int, capital_relation: str = "at least",
                   **_: Any) -> bool:
    caps = [w for w in _words(text) if w.isupper()]
    return _compare(len(caps), capital_frequency, capital_relation)


def _postscript(text: str, postscript_marker: str, **_: Any) -> bool:
    return re.search(rf"(^|\n)\s*{re.escape(postscript_marker.lower())}", text.lower()) is not None


def _two_responses(text: str, **_: Any) -> bool:
    parts = [p.strip() for p in text.split("******")]
    return len(parts) == 2 and all(parts) and parts[0] != parts[1]


SUPPORTED: dict[str, Check] = {
    "keywords:existence": _existence,
    "keywords:forbidden_words": _forbidden,
    "keywords:frequency": _frequency,
    "keywords:letter_frequency": _letter_frequency,
    "length_constraints:number_words": _number_words,
    "length_constraints:number_sentences": _number_sentences,
    "length_constraints:number_paragraphs": _number_paragraphs,
    "detectable_format:number_bullet_lists": _bullets,
    "detectable_format:number_highlighted_sections": _highlights,
    "detectable_format:multiple_sections": _sections,
    "detectable_format:json_format": _json,
    "detectable_format:title": lambda text, **_: re.search(r"<<[^\n]+>>", text) is not None,
    "detectable_format:constrained_response": lambda text, **_: any(
        f"my answer is {a}" in text.lower() for a in ("yes.", "no.", "maybe.")),
    "detectable_content:postscript": _postscript,
    "detectable_content:number_placeholders": lambda text, num_placeholders, **_: len(
        re.findall(r"\[[^\[\]\n]+\]", text)) >= num_placeholders,
    "change_case:english_lowercase": lambda text, **_: text == text.lower(),
    "change_case:english_capital": lambda text, **_: text == text.upper(),
    "change_case:capital_word_frequency": _capital_words,
    "punctuation:no_comma": lambda text, **_: "," not in text and "，" not in text,
    "startend:end_checker": lambda text, end_phrase, **_: text.strip().lower().endswith(
        end_phrase.strip().lower()),
    "startend:quotation": lambda text, **_: len(t := text.strip()) > 1 and t[0] == t[-1] == '"',
    "combination:repeat_prompt": lambda text, prompt_to_repeat, **_: text.strip().lower()
        .startswith(prompt_to_repeat.strip().lower()),
    "combination:two_responses": _two_responses,
}


def check_instructions(response: str, instruction_ids: list[str],
                       kwargs: list[dict[str, Any] | None]) -> list[bool]:
    """Whether `response` follows each instruction, in order.

    >>> check_instructions("hello world", ["punctuation:no_comma",
    ...     "length_constraints:number_words"], [{}, {"num_words": 3, "relation": "at least"}])
    [True, False]
    """
    results = []
    for i, instruction in enumerate(instruction_ids):
        check = SUPPORTED.get(instruction)
        if check is None:
            raise ValueError(f"ifeval: instruction {instruction!r} is not supported; the "
                             f"supported ones are {sorted(SUPPORTED)}")
        args = {k: v for k, v in ((kwargs[i] if i < len(kwargs) else None) or {}).items()
                if v is not None}
        results.append(bool(check(response, **args)))
    return results


@register("ifeval")
def ifeval_reward(inp: RewardInput) -> float:
    """The fraction of `metadata["instruction_id_list"]` the response follows.

    >>> meta = {"instruction_id_list": ["change_case:english_lowercase",
    ...         "startend:end_checker"], "kwargs": [{}, {"end_phrase": "Any questions?"}]}
    >>> ifeval_reward(RewardInput(prompt="", response="all quiet. any questions?", label=None,
    ...     metadata=meta))
    1.0
    >>> ifeval_reward(RewardInput(prompt="", response="All quiet.", label=None, metadata=meta))
    0.0
    """
    metadata = inp.metadata or {}
    ids = metadata.get("instruction_id_list")
    if not ids:
        raise ValueError("ifeval needs metadata.instruction_id_list (and metadata.kwargs); set "
                         "data.metadata_key to the column holding them")
    followed = check_instructions(final_text(inp.response), list(ids),
                                  list(metadata.get("kwargs") or []))
    return sum(followed) / len(followed)
