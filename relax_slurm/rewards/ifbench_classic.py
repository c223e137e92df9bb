"""IFBench's checks of the 25 classic IFEval instructions (its `classic_instructions.py`).

The same contract as `ifbench_checks`: `check(text, **kwargs) -> bool` with the keyword
arguments of IFBench's `build_description`, giving IFBench's verdicts. Keywords, forbidden words
and section splitters are regular expressions, not escaped, as in IFEval. The five classic ids
whose checker needs NLTK or langdetect are in `ifbench_nlp`.
"""

from __future__ import annotations

import collections
import json
import re
from typing import Any

from relax_slurm.rewards.ifbench_checks import Check, compare, count_words


def existence(text: str, keywords: list[str], **_: Any) -> bool:
    return all(re.search(k, text, flags=re.IGNORECASE) for k in keywords)


def frequency(text: str, keyword: str, frequency: int, relation: str, **_: Any) -> bool:
    return compare(len(re.findall(keyword.strip(), text, flags=re.IGNORECASE)), frequency,
                   relation)


def forbidden_words(text: str, forbidden_words: list[str], **_: Any) -> bool:
    return not any(re.search(r"\b" + w + r"\b", text, flags=re.IGNORECASE)
                   for w in set(forbidden_words))


def letter_frequency(text: str, letter: str, let_frequency: int, let_relation: str,
                     **_: Any) -> bool:
    counts = collections.Counter(text.lower())
    return compare(counts[letter.strip().lower()], let_frequency, let_relation)


def number_words(text: str, num_words: int, relation: str, **_: Any) -> bool:
    return compare(count_words(text), num_words, relation)


def number_paragraphs(text: str, num_paragraphs: int, **_: Any) -> bool:
    paragraphs = re.split(r"\s?\*\*\*\s?", text)
    count = len(paragraphs)
    for i, paragraph in enumerate(paragraphs):
        if not paragraph.strip():
            if i in (0, len(paragraphs) - 1):
                count -= 1
            else:
                return False
    return count == num_paragraphs


def nth_paragraph_first_word(text: str, num_paragraphs: int, nth_paragraph: int,
                             first_word: str, **_: Any) -> bool:
    paragraphs = re.split(r"\n\n", text)
    count = sum(1 for p in paragraphs if p.strip())
    if nth_paragraph > count or not paragraphs[nth_paragraph - 1].strip():
        return False
    word = paragraphs[nth_paragraph - 1].strip().split()[0].strip().lstrip("'").lstrip('"')
    first = ""
    for letter in word:
        if letter in {".", ",", "?", "!", "'", '"'}:
            break
        first += letter.lower()
    return count == num_paragraphs and first == first_word.lower()


def postscript(text: str, postscript_marker: str, **_: Any) -> bool:
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + marker.lower() + r".*$"
    return bool(re.findall(pattern, text.lower(), flags=re.MULTILINE))


def bullet_lists(text: str, num_bullets: int, **_: Any) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


def highlighted_sections(text: str, num_highlights: int, **_: Any) -> bool:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", text) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", text)
              if h.removeprefix("**").removesuffix("**").strip()]
    return len(single) + len(double) >= num_highlights


def multiple_sections(text: str, section_spliter: str, num_sections: int, **_: Any) -> bool:
    return len(re.split(r"\s?" + section_spliter.strip() + r"\s?\d+\s?", text)) - 1 >= num_sections


def json_format(text: str, **_: Any) -> bool:
    body = text.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(prefix)
    try:
        json.loads(body.removesuffix("```").strip())
    except ValueError:
        return False
    return True


def title(text: str, **_: Any) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", text))


def two_responses(text: str, **_: Any) -> bool:
    parts = text.split("******")
    valid = []
    for i, part in enumerate(parts):
        if not part.strip():
            if i not in (0, len(parts) - 1):
                return False
        else:
            valid.append(part)
    return len(valid) == 2 and valid[0].strip() != valid[1].strip()


def end_checker(text: str, end_phrase: str, **_: Any) -> bool:
    return text.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def quotation(text: str, **_: Any) -> bool:
    t = text.strip()
    return len(t) > 1 and t[0] == t[-1] == '"'


CLASSIC: dict[str, Check] = {
    "keywords:existence": existence,
    "keywords:frequency": frequency,
    "keywords:forbidden_words": forbidden_words,
    "keywords:letter_frequency": letter_frequency,
    "length_constraints:number_paragraphs": number_paragraphs,
    "length_constraints:number_words": number_words,
    "length_constraints:nth_paragraph_first_word": nth_paragraph_first_word,
    "detectable_content:number_placeholders": lambda text, num_placeholders, **_: len(
        re.findall(r"\[.*?\]", text)) >= num_placeholders,
    "detectable_content:postscript": postscript,
    "detectable_format:number_bullet_lists": bullet_lists,
    "detectable_format:constrained_response": lambda text, **_: any(
        r in text.strip() for r in ("My answer is yes.", "My answer is no.",
                                    "My answer is maybe.")),
    "detectable_format:number_highlighted_sections": highlighted_sections,
    "detectable_format:multiple_sections": multiple_sections,
    "detectable_format:json_format": json_format,
    "detectable_format:title": title,
    "combination:two_responses": two_responses,
    "combination:repeat_prompt": lambda text, prompt_to_repeat, **_: text.strip().lower()
        .startswith(prompt_to_repeat.strip().lower()),
    "startend:end_checker": end_checker,
    "punctuation:no_comma": lambda text, **_: not re.search(r"\,", text),
    "startend:quotation": quotation,
}
