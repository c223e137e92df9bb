"""IFBench's checkers that lean on NLTK, langdetect, syllapy or emoji (the `ifbench` extra).

Same contract as `ifbench_checks`: `check(text, **kwargs) -> bool` with the keyword arguments of
the IFBench instruction's `build_description`, counting what IFBench's `check_following` counts.
The packages come with `pip install "relax-slurm[ifbench]"` (nltk, langdetect, syllapy, emoji;
`.[dev]` has them); each is imported on first use, and a missing one raises naming that extra.

What cannot be had here is NLTK's *trained* data (`nltk.download` needs the network):
- sentences: IFBench splits with the English punkt model (`nltk.sent_tokenize`, and the punkt
  pickle for `length_constraints:number_sentences`). `sentences()` runs the same Punkt algorithm
  untrained: it breaks after `.`, `?` and `!` followed by white space as the model does, but knows
  no English abbreviations, so "Dr. Smith" or "e.g. this" are two sentences here and one there;
- words: `nltk.word_tokenize` is the Treebank word tokenizer run on each punkt sentence;
  `words()` runs it on each of `sentences()`, so it differs only where the sentences do (a
  sentence-final period splits from its word, others stay attached, as in NLTK);
- stop words: NLTK's English list is corpus data; `STOP_WORDS` holds its entries that can match
  a `\\w+` token (IFBench tokenises with `\\w+`, so the entries with an apostrophe never count);
- the POS tagger (`words:start_verb`) has no untrained form and stays unsupported.

langdetect is random unless seeded; IFBench leaves it unseeded (a borderline text can flip from
run to run), `_detect` seeds it so a reward is reproducible.
"""

from __future__ import annotations

import functools
import importlib
import re
import string
from types import ModuleType
from typing import Any

import regex

from relax_slurm.rewards.ifbench_checks import Check, compare, count_words

EXTRA = 'pip install "relax-slurm[ifbench]" (nltk, langdetect, syllapy, emoji)'
_DROP_PUNCT = str.maketrans("", "", string.punctuation)

# NLTK's English stop words (the `stopwords` corpus, its 179-word list) without the entries
# holding an apostrophe ("don't", "should've", and any contraction a later data release adds):
# IFBench looks up the `\w+` tokens of the text, which never hold one, so only these can match.
STOP_WORDS = frozenset("""
i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she
her hers herself it its itself they them their theirs themselves what which who whom this that
these those am is are was were be been being have has had having do does did doing a an the and
but if or because as until while of at by for with about against between into through during
before after above below to from up down in out on off over under again further then once here
there when where why how all any both each few more most other some such no nor not only own
same so than too very s t can will just don should now d ll m o re ve y ain aren couldn didn
doesn hadn hasn haven isn ma mightn mustn needn shan shouldn wasn weren won wouldn
""".split())

# IFBench's `count:pronouns` set (its checker's list, grouped as there)
PRONOUNS = frozenset("""
i me we us you he him she her it they them
my mine our ours your yours his hers its their theirs
myself ourselves yourself yourselves himself herself itself themselves
this that these those  who whom whose which what  whoever whomever whatever whichever
anybody anyone anything everybody everyone everything nobody nothing somebody someone something
each either neither both all some any none
""".split())


def _require(module: str) -> ModuleType:
    """Import an optional package, or raise naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"ifbench: this instruction's checker needs the {module!r} package. "
                          f"Fix: {EXTRA}") from e


@functools.lru_cache(maxsize=1)
def _sentence_splitter() -> Any:
    # untrained: empty abbreviation, collocation and sentence-starter lists (module docstring)
    return _require("nltk.tokenize.punkt").PunktSentenceTokenizer()


@functools.lru_cache(maxsize=1)
def _word_tokenizer() -> Any:
    return _require("nltk.tokenize.destructive").NLTKWordTokenizer()


def sentences(text: str) -> list[str]:
    """IFBench's `split_into_sentences` with untrained Punkt (see the module docstring).

    >>> sentences("One. Two? Three! four")
    ['One.', 'Two?', 'Three!', 'four']
    """
    return _sentence_splitter().tokenize(text)


def words(text: str) -> list[str]:
    """`nltk.word_tokenize` on `sentences()`: Treebank tokens, sentence by sentence.

    >>> words("Don't stop. Go, now.")
    ['Do', "n't", 'stop', '.', 'Go', ',', 'now', '.']
    """
    tokenizer = _word_tokenizer()
    return [token for sentence in sentences(text) for token in tokenizer.tokenize(sentence)]


def _strip_punct_words(sentence: str) -> list[str]:
    """A sentence's white-space words after dropping ASCII punctuation (IFBench's idiom)."""
    return sentence.translate(_DROP_PUNCT).split()


# --- the classic IFEval ids (IFBench's classic_instructions.py) ---

def _detect(text: str) -> str | None:
    """langdetect's language code, None where it finds no features (IFBench then passes)."""
    langdetect = _require("langdetect")
    langdetect.DetectorFactory.seed = 0  # reproducible verdicts (module docstring)
    try:
        return langdetect.detect(text)
    except langdetect.LangDetectException:
        return None


def response_language(text: str, language: str, **_: Any) -> bool:
    detected = _detect(text)
    return detected is None or detected == language


def number_sentences(text: str, num_sentences: int, relation: str, **_: Any) -> bool:
    return compare(len(sentences(text)), num_sentences, relation)


def english_capital(text: str, **_: Any) -> bool:
    # the case test comes first (langdetect is the slow part); undetectable text passes, as there
    if not text.isupper():
        return False
    return _detect(text) in (None, "en")


def english_lowercase(text: str, **_: Any) -> bool:
    if not text.islower():
        return False
    return _detect(text) in (None, "en")


def capital_word_frequency(text: str, capital_frequency: int, capital_relation: str,
                           **_: Any) -> bool:
    return compare(sum(1 for w in words(text) if w.isupper()), capital_frequency,
                   capital_relation)


# --- IFBench's own instructions (instructions.py) ---

def stop_words(text: str, percentage: float, **_: Any) -> bool:
    total = count_words(text)
    if total == 0:
        return False
    tokens = regex.findall(r"\w+", text)  # as count_words: NLTK 3.10's RegexpTokenizer
    stops = sum(1 for t in tokens if t.lower() in STOP_WORDS)
    return stops / total * 100 <= percentage


def _ending_counts(text: str) -> tuple[int, int, int]:
    """Sentences ending in `.`, `?` and `!`."""
    ends = [s[-1:] for s in sentences(text)]
    return ends.count("."), ends.count("?"), ends.count("!")


def sentence_type(text: str, **_: Any) -> bool:
    declarative, interrogative, _exclamatory = _ending_counts(text)
    return declarative == 2 * interrogative  # 2:1, so no sentence of either kind also passes


def sentence_balance(text: str, **_: Any) -> bool:
    declarative, interrogative, exclamatory = _ending_counts(text)
    return declarative == interrogative == exclamatory


def _alliteration(sentence: str) -> int:
    """Words in runs of two or more sharing a first letter (a run of k counts k)."""
    cleaned = [w.lstrip(string.punctuation + " ") for w in sentence.lower().split()]
    cleaned = [w for w in cleaned if w]
    score, in_run = 0, False
    for a, b in zip(cleaned, cleaned[1:]):
        if a[0] == b[0]:
            score += 1 if in_run else 2
            in_run = True
        else:
            in_run = False
    return score


def alliteration_increment(text: str, **_: Any) -> bool:
    scores = [_alliteration(s) for s in sentences(text)]
    # strictly rising, and the first sentence only needs >= 0 (IFBench starts from -1)
    return all(b > a for a, b in zip([-1, *scores], scores))


def _ends_with_emoji(stripped: str, is_emoji: Any) -> bool:
    # the last or second-last character: an emoji's variation selector can come last
    return is_emoji(stripped[-1]) or is_emoji(stripped[-2] if len(stripped) > 1 else stripped[-1])


def emoji_sentences(text: str, **_: Any) -> bool:
    """Every sentence ends with an emoji, or (for all but the last) the next one starts with one:
    Punkt puts an emoji after a full stop at the start of the next sentence."""
    is_emoji = _require("emoji").is_emoji
    parts = [s.translate(_DROP_PUNCT).strip() for s in sentences(text)]
    for i, stripped in enumerate(parts):
        if not stripped:
            return False
        if _ends_with_emoji(stripped, is_emoji):
            continue
        if i == len(parts) - 1 or not parts[i + 1] or not is_emoji(parts[i + 1][0]):
            return False
    return True


def sentence_words(text: str, **_: Any) -> bool:
    """Three sentences of the same length in characters (IFBench checks no more than that)."""
    found = [s.strip() for s in sentences(text)]
    return len(found) == 3 and len({len(s) for s in found}) == 1


def sentence_keyword(text: str, word: str, N: int, **_: Any) -> bool:
    found = sentences(text)
    if len(found) < N:
        return False
    return bool(re.search(rf"\b{re.escape(word)}\b", found[int(N - 1)], re.IGNORECASE))


def pronouns(text: str, N: int, **_: Any) -> bool:
    # "she/her" is two pronouns: the slash becomes a space first, as in IFBench
    tokens = words(text.replace("/", " ").lower())
    return sum(1 for t in tokens if t in PRONOUNS) >= N


def odd_even_syllables(text: str, **_: Any) -> bool:
    count = _require("syllapy").count
    parities = [count(w) % 2 for w in text.translate(_DROP_PUNCT).lower().split()]
    return all(a != b for a, b in zip(parities, parities[1:]))


def last_first(text: str, **_: Any) -> bool:
    found = sentences(text)
    edge = string.punctuation + " "
    for prev, nxt in zip(found, found[1:]):
        last, first = prev.rstrip(edge).split(), nxt.lstrip(edge).split()
        if not last or not first or last[-1].lower() != first[0].lower():
            return False
    return True


def sentence_increment(text: str, small_n: int, **_: Any) -> bool:
    counts = [len(_strip_punct_words(s)) for s in sentences(text)]
    if not counts:
        # IFBench indexes the first sentence and raises on a text with none; check() only sees
        # non-blank text, which Punkt always splits into at least one sentence
        return False
    return all(b == a + small_n for a, b in zip(counts, counts[1:]))


def no_bullets_bullets(text: str, **_: Any) -> bool:
    """At least two sentences of prose, then at least two `*` lines and nothing after them.

    >>> no_bullets_bullets("I came. I saw.\\n* x\\n* y")
    True
    >>> no_bullets_bullets("I came.\\n\\nI saw.\\n* x\\n* y")  # prose after a blank line
    False
    """
    in_prose, prose_sentences, bullets = True, 0, 0
    for line in text.split("\n"):
        if line.strip().startswith("*"):
            in_prose = False
            if prose_sentences < 2:
                return False
            bullets += 1
        elif in_prose:
            found = sentences(line.strip())
            prose_sentences += len(found)
            # IFBench reuses its "still in prose" flag for this list: a blank line ends the prose,
            # and prose after it fails as if it followed the bullets
            in_prose = bool(found)
        else:
            return False  # prose (even a blank line) after the bullets
    return bullets >= 2


def word_reverse(text: str, **_: Any) -> bool:
    # IFBench's test: the reversed word order mentions "bald eagle" and is one whole sentence
    reversed_text = " ".join(text.lower().strip().translate(_DROP_PUNCT).split()[::-1])
    return "bald eagle" in reversed_text and reversed_text in sentences(reversed_text)


def sentence_alphabet(text: str, **_: Any) -> bool:
    found = sentences(text)
    if len(found) != 26:
        return False
    for letter, sentence in zip(string.ascii_lowercase, found):
        first = sentence.lstrip().split()
        if not first or first[0].lower()[0] != letter:
            return False
    return True


def keywords_specific_position(text: str, keyword: str, n: int, m: int, **_: Any) -> bool:
    found = sentences(text)
    if len(found) < n:
        return False
    tokens = [t for t in words(found[n - 1]) if any(c.isalnum() for c in t)]
    return len(tokens) >= m and tokens[m - 1].lower() == keyword.strip().lower()


def words_position(text: str, keyword: str, **_: Any) -> bool:
    """The second token and the second-to-last word (skipping one final punctuation token)."""
    tokens = words(text)
    key = keyword.strip().lower()
    if tokens and tokens[-1] in string.punctuation:
        return len(tokens) >= 3 and tokens[1].lower() == tokens[-3].lower() == key
    return len(tokens) >= 2 and tokens[1].lower() == tokens[-2].lower() == key


def title_case(text: str, **_: Any) -> bool:
    """No word starting with a lower-case letter, except one whose tail mixes cases: IFBench
    fails `cat`, `a` and `eBAY` but passes `iPhone` (and `NASA`, `McDonald`)."""
    for token in words(text):
        if not token or not token[0].isalpha():
            continue
        if token[0].islower():
            if len(token) == 1 or token[1:].islower() or token[1:].isupper():
                return False
    return True


NLP: dict[str, Check] = {
    "language:response_language": response_language,
    "length_constraints:number_sentences": number_sentences,
    "change_case:english_capital": english_capital,
    "change_case:english_lowercase": english_lowercase,
    "change_case:capital_word_frequency": capital_word_frequency,
    "ratio:stop_words": stop_words,
    "ratio:sentence_type": sentence_type,
    "ratio:sentence_balance": sentence_balance,
    "sentence:alliteration_increment": alliteration_increment,
    "format:emoji": emoji_sentences,
    "ratio:sentence_words": sentence_words,
    "sentence:keyword": sentence_keyword,
    "count:pronouns": pronouns,
    "words:odd_even_syllables": odd_even_syllables,
    "words:last_first": last_first,
    "sentence:increment": sentence_increment,
    "format:no_bullets_bullets": no_bullets_bullets,
    "custom:word_reverse": word_reverse,
    "custom:sentence_alphabet": sentence_alphabet,
    "words:keywords_specific_position": keywords_specific_position,
    "words:words_position": words_position,
    "format:title_case": title_case,
}
