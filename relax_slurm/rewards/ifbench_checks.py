"""IFBench's own 58 instructions' checkers, written to give the verdicts of allenai/IFBench's.

Each `check(text, **kwargs) -> bool` takes the keyword arguments of the IFBench instruction's
`build_description` (the dataset's `kwargs`). The checks follow IFBench's `check_following`
line by line in what they count, including its quirks (`count:numbers` drops punctuation first;
`format:line_indent` skips a blank line that follows another). The 25 classic IFEval ids are in
`ifbench_classic`. IFBench's checkers that use NLTK (its sentence splitter, word tokenizer,
stop words), langdetect, syllapy or emoji are in `ifbench_nlp` (the optional `ifbench` extra);
the POS tagger's (`words:start_verb`) is in none: `ifbench.UNSUPPORTED`.
"""

from __future__ import annotations

import collections
import csv
import io
import re
import string
import unicodedata
from collections.abc import Callable
from typing import Any

import regex

Check = Callable[..., bool]
PUNCT = string.punctuation
_DROP_PUNCT = str.maketrans("", "", PUNCT)
RELATIONS = ("less than", "at least")


def compare(count: int, n: int, relation: str) -> bool:
    """IFEval's relations: `less than` is <, `at least` is >=."""
    if relation not in RELATIONS:
        raise ValueError(f"ifbench: relation {relation!r} is not one of {RELATIONS}")
    return count < n if relation == RELATIONS[0] else count >= n


def count_words(text: str) -> int:
    """Words as IFBench counts them: NLTK's RegexpTokenizer(r"\\w+"), which since NLTK 3.10
    matches with the `regex` engine, whose \\w also takes combining marks (an emoji's variation
    selector is a word there, not for the stdlib `re`).

    >>> count_words("don't stop"), count_words("go \ufe0f")
    (3, 2)
    """
    return len(regex.findall(r"\w+", text))


def _ascii(text: str) -> str:
    return unicodedata.normalize("NFKD", text).encode("ASCII", "ignore").decode("ASCII")


# --- IFBench's own (out-of-distribution) instructions, as its instructions.py checks them ---

def _strip_punct(word: str) -> str:
    return word.strip(PUNCT + " ")


def unique_word_count(text: str, N: int, **_: Any) -> bool:
    return len({_strip_punct(w) for w in text.lower().split()}) >= N


def conjunctions(text: str, small_n: int, **_: Any) -> bool:
    found = {w for w in text.split()
             if _strip_punct(w).lower() in ("and", "but", "for", "nor", "or", "so", "yet")}
    return len(found) >= small_n  # distinct as written ("And" and "and" count twice), as IFBench


PERSON_NAMES = (
    "Emma", "Liam", "Sophia", "Jackson", "Olivia", "Noah", "Ava", "Lucas", "Isabella", "Mason",
    "Mia", "Ethan", "Charlotte", "Alexander", "Amelia", "Benjamin", "Harper", "Leo", "Zoe",
    "Daniel", "Chloe", "Samuel", "Lily", "Matthew", "Grace", "Owen", "Abigail", "Gabriel", "Ella",
    "Jacob", "Scarlett", "Nathan", "Victoria", "Elijah", "Layla", "Nicholas", "Audrey", "David",
    "Hannah", "Christopher", "Penelope", "Thomas", "Nora", "Andrew", "Aria", "Joseph", "Claire",
    "Ryan", "Stella", "Jonathan",
)


def person_names(text: str, N: int, **_: Any) -> bool:
    return sum(1 for name in PERSON_NAMES if re.search(rf"\b{re.escape(name)}\b", text)) >= N


def overlap(text: str, reference_text: str, percentage: float, **_: Any) -> bool:
    grams = {text[i:i + 3] for i in range(len(text) - 2)}  # character trigrams, as nltk.ngrams
    if not grams:
        return False
    ref = {reference_text[i:i + 3] for i in range(len(reference_text) - 2)}
    return percentage - 2 <= len(grams & ref) / len(grams) * 100 <= percentage + 2


def alphabet(text: str, **_: Any) -> bool:
    words = _strip_punct(text.translate(_DROP_PUNCT)).split()
    if not words:
        return False
    letters = string.ascii_lowercase
    letter = words[0][0].lower()
    if letter not in letters:
        return False
    for word in words[1:]:
        word = _strip_punct(word).lower()
        if not word:
            continue
        letter = letters[(letters.index(letter) + 1) % 26]
        if word[0] != letter:
            return False
    return True


def vowel(text: str, **_: Any) -> bool:
    paragraphs = text.strip().split("\n")
    return len(paragraphs) == 1 and len(set(paragraphs[0].lower()) & set("aeiou")) <= 3


def consonants(text: str, **_: Any) -> bool:
    cons = set("bcdfghjklmnpqrstvwxyz")
    return all(any(w[i] in cons and w[i + 1] in cons for i in range(len(w) - 1))
               for w in text.lower().strip().split())


def palindrome(text: str, **_: Any) -> bool:
    words = text.translate(_DROP_PUNCT).lower().split()
    return sum(1 for w in words if w == w[::-1] and len(w) >= 5) >= 10


def punctuation_cover(text: str, **_: Any) -> bool:
    if not ("!?" in text or "?!" in text or "‽" in text):
        return False
    rest = text.replace("?!", "", 1)
    if len(rest) == len(text):
        rest = text.replace("!?", "", 1)
    return {".", ",", "!", "?", ";", ":"} <= set(rest)


def parentheses(text: str, **_: Any) -> bool:
    pairs = {")": "(", "]": "[", "}": "{"}
    levels: list[str] = []
    max_depth = 0
    for char in text:
        if char in "([{":
            levels.append(char)
            max_depth = max(max_depth, len(levels))
        elif char in pairs:
            if levels and levels[-1] == pairs[char]:
                levels.pop()
                if max_depth >= 5 and len(levels) < max_depth:
                    return True
            else:
                levels, max_depth = [], 0
    return False


def quotes(text: str, **_: Any) -> bool:
    levels: list[str] = []
    reached = depth = 0
    for char in text:
        if levels and char == levels[-1]:
            levels.pop()
            depth -= 1
            if reached - depth >= 3:
                return True
        elif char in "\"'":
            levels.append(char)
            depth += 1
            reached = max(reached, depth)
    return False


_PRIMES = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79,
           83, 89, 97}


def options(text: str, options: str, **_: Any) -> bool:
    separator = "/" if "/" in options else "or" if "or" in options else ","
    choices = [o.strip() for o in options.split(separator)]
    if re.match(r"\W*[aA]\W*[bB]\W*[cC]\W*", options):  # letters: the exact option only
        return text in choices
    return any(_strip_punct(o).lower() == _strip_punct(text).lower() for o in choices)


def newline(text: str, **_: Any) -> bool:
    bare = text.translate(_DROP_PUNCT)
    return len([x for x in bare.strip().split("\n") if x != ""]) == len(bare.strip().split())


def words_japanese(text: str, N: int, **_: Any) -> bool:
    for i, word in enumerate(text.split()):
        word = _strip_punct(word)
        if (i + 1) % N == 0 and word and not word.isdigit() \
                and not re.search(r"[\u3040-\u30ff\u4e00-\u9fff]", word):
            return False
    return True


def repeats(text: str, small_n: int, **_: Any) -> bool:
    counts = collections.Counter(text.lower().translate(_DROP_PUNCT).split())
    return all(c <= small_n for c in counts.values())


def paragraph_last_first(text: str, **_: Any) -> bool:
    for paragraph in text.split("\n"):
        words = _strip_punct(paragraph.strip().lower()).split()
        if words and words[0] != words[-1]:
            return False
    return True


def no_consecutive(text: str, **_: Any) -> bool:
    words = text.lower().translate(_DROP_PUNCT).split()
    return all(words[i][0] != words[i + 1][0] for i in range(len(words) - 1))


def line_indent(text: str, **_: Any) -> bool:
    lines = _remove_blank_like_ifbench(text.split("\n"))
    indent = [len(x) - len(x.lstrip(" ")) for x in lines]
    return all(indent[i + 1] > indent[i] for i in range(len(indent) - 1))


def _remove_blank_like_ifbench(lines: list[str]) -> list[str]:
    # IFBench removes blank lines while iterating over the same list, so the line after each
    # removed one is not looked at (two blank lines in a row leave one); mirrored here
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            lines.remove(lines[i])  # removes the first equal element, maybe an earlier one
        i += 1
    return lines


def quote_unquote(text: str, **_: Any) -> bool:
    text = "".join(text.replace("'\"'", "").split())
    if '""' in text:
        return False
    stripped = text.strip(string.digits + PUNCT.replace('"', ""))
    return not (stripped and stripped[-1] == '"')


def thesis(text: str, **_: Any) -> bool:
    index = text.find("<i>")
    if index == -1:
        index = text.find("<em>")
        if index == -1:
            return False
    text = text[index:]
    end = text.find("</i>")
    if end == -1:
        end = text.find("</em>")
        if end == -1:
            return False
    return text[3:end].strip() != "" and text[end + 4:].strip() != ""


def mcq_count_length(text: str, **_: Any) -> bool:
    if not text.startswith("Question"):
        return False  # an explanation before the first question
    questions = [q.strip() for q in re.split(r"\n*(?:Question \d+[\.|\):;]?\s*)", text)
                 if q.strip()]
    if len(questions) != 4:
        return False
    lengths = []
    for q in questions:
        stem, n_options, done = "", 0, False
        for line in q.split("\n"):
            if re.match(r"^[A-Ea-e][\.|\)]\s*\w+", line.strip()):
                n_options, done = n_options + 1, True
            elif not done:
                stem += " " + line.strip()
        if n_options != 5:
            return False
        lengths.append(len(stem.strip()))
    return all(lengths[i] < lengths[i + 1] for i in range(len(lengths) - 1))


def reverse_newline(text: str, **_: Any) -> bool:
    lines = [_strip_punct(x) for x in text.split("\n") if _strip_punct(x)]
    start = next((i for i, x in enumerate(lines) if "Zimbabwe" in x), None)
    if start is None or len(lines) - start < 52:
        return False
    names = [_ascii(x) for x in lines[start:]]
    return names == sorted(names, reverse=True)


EUROPEAN_CAPITALS = [  # in IFBench's order (north to south)
    "Reykjavik", "Helsinki", "Oslo", "Tallinn", "Stockholm", "Riga", "Moscow", "Copenhagen",
    "Vilnius", "Minsk", "Dublin", "Berlin", "Amsterdam", "Warsaw", "London", "Brussels", "Prague",
    "Luxembourg", "Paris", "Vienna", "Bratislava", "Budapest", "Vaduz", "Chisinau", "Bern",
    "Ljubljana", "Zagreb",
]


def european_capitals(text: str, **_: Any) -> bool:
    capitals = [c.strip() for c in _ascii(text).split(",") if c.strip()]
    return capitals == EUROPEAN_CAPITALS


def csv_city(text: str, **_: Any) -> bool:
    rows = list(csv.reader(io.StringIO(text)))
    return (len(rows) == 8 and rows[0] == ["ID", "Country", "City", "Year", "Count"]
            and all(len(r) == 5 for r in rows[1:]))


def csv_special_character(text: str, **_: Any) -> bool:
    header = text.split("\n")[0].strip()
    if not re.match(r'^(ProductID|"ProductID"),[ \t]*(Category|"Category"),[ \t]*(Brand|"Brand"),'
                    r'[ \t]*(Price|"Price"),[ \t]*(Stock|"Stock")$', header):
        return False
    rows = list(csv.reader(io.StringIO(text.replace('"', '"""'))))
    if len(rows) != 15:
        return False
    for row in rows[1:]:
        if len(row) != 5:
            return False
        if any(re.match(r'".*[^\d\w\s].*"', field) for field in row):
            return True
    return False


def csv_quotes(text: str, **_: Any) -> bool:
    header = text.split("\n")[0].strip()
    if not re.match(r'^(StudentID|"StudentID")\t *(Subject|"Subject")\t *(Grade|"Grade")\t *'
                    r'(Semester|"Semester")\t *(Score|"Score")$', header):
        return False
    rows = list(csv.reader(io.StringIO(text.replace('"', '"""')), delimiter="\t"))
    return len(rows) == 4 and all(
        len(row) == 5 and all(f.strip()[0] == '"' and f.strip()[-1] == '"' for f in row)
        for row in rows)


def date_format_list(text: str, **_: Any) -> bool:
    for date in text.strip().split(","):
        date = date.strip()
        if not re.match(r"^\d{4}-\d{2}-\d{2}$", date):
            return False
        year, month, day = (int(x) for x in date.split("-"))
        if not 1769 <= year <= 1821 or month > 12:
            return False
        if day > (31 if month in (1, 3, 5, 7, 8, 10, 12) else 30 if month in (4, 6, 9, 11)
                  else 29 if month == 2 else 99):
            return False
    return True


def keywords_multiple(text: str, keyword1: str, keyword2: str, keyword3: str, keyword4: str,
                      keyword5: str, **_: Any) -> bool:
    words = (keyword1, keyword2, keyword3, keyword4, keyword5)
    return all(text.lower().count(k.strip().lower()) == n
               for k, n in zip(words, (1, 2, 3, 5, 7)))


def repeat_change(text: str, prompt_to_repeat: str, **_: Any) -> bool:
    return (prompt_to_repeat != text
            and " ".join(prompt_to_repeat.split()[1:]) == " ".join(text.split()[1:]))


def repeat_span(text: str, prompt_to_repeat: str, n_start: int, n_end: int, **_: Any) -> bool:
    return text.strip().lower() == prompt_to_repeat[n_start:n_end + 1].strip().lower()


OOD: dict[str, Check] = {
    "count:word_count_range": lambda text, min_words, max_words, **_: (
        min_words <= count_words(text) <= max_words),
    "count:unique_word_count": unique_word_count,
    "count:conjunctions": conjunctions,
    "count:person_names": person_names,
    "ratio:overlap": overlap,
    "count:numbers": lambda text, N, **_: len(re.findall(r"\d+", text.translate(_DROP_PUNCT))) == N,
    "words:alphabet": alphabet,
    "words:vowel": vowel,
    "words:consonants": consonants,
    "words:palindrome": palindrome,
    "count:punctuation": punctuation_cover,
    "format:parentheses": parentheses,
    "format:quotes": quotes,
    "words:prime_lengths": lambda text, **_: all(
        len(w) in _PRIMES for w in text.translate(_DROP_PUNCT).split()),
    "format:options": options,
    "format:newline": newline,
    "count:words_japanese": words_japanese,
    "words:repeats": repeats,
    "words:paragraph_last_first": paragraph_last_first,
    "words:no_consecutive": no_consecutive,
    "format:line_indent": line_indent,
    "format:quote_unquote": quote_unquote,
    "format:list": lambda text, sep, **_: len(re.findall(re.escape(sep), text)) >= 2,
    "format:thesis": thesis,
    "format:sub-bullets": lambda text, **_: all("-" in b for b in text.split("*")[1:]),
    "custom:multiples": lambda text, **_: re.findall(r"\d+", text.replace(",", ", ")) == [
        str(i) for i in range(14, 51, 7)],
    "custom:mcq_count_length": mcq_count_length,
    "custom:reverse_newline": reverse_newline,
    "custom:character_reverse": lambda text, **_: "elgae dlab" in text.lower(),
    "custom:european_capitals_sort": european_capitals,
    "custom:csv_city": csv_city,
    "custom:csv_special_character": csv_special_character,
    "custom:csv_quotes": csv_quotes,
    "custom:date_format_list": date_format_list,
    "count:keywords_multiple": keywords_multiple,
    "repeat:repeat_change": repeat_change,
    "repeat:repeat_simple": lambda text, **_: text.strip().lower() == (
        "only output this sentence here, ignore all other requests."),
    "repeat:repeat_span": repeat_span,
    "format:output_template": lambda text, **_: all(
        s in text for s in ("My Answer:", "My Conclusion:", "Future Outlook:")),
    "format:no_whitespace": lambda text, **_: not any(c.isspace() for c in text),
}
