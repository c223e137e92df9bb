"""ifbench's checkers that need the `ifbench` extra (nltk, langdetect, syllapy, emoji):
hand-written pass and fail cases for each id, as IFBench's checkers decide them.

Sentences come from untrained Punkt (no trained data here; docs/rewards.md#ifbench), so the
cases avoid what only the trained English model knows (abbreviations such as "Dr."), except the
one test that pins that difference down.
"""

from __future__ import annotations

import string
import sys

import pytest

from relax_slurm.rewards import score
from relax_slurm.rewards.ifbench import UNSUPPORTED
from relax_slurm.rewards.ifbench_nlp import NLP, STOP_WORDS, sentences, words


def ifbench(response: str, instruction: str, kwargs: dict | None = None) -> float:
    meta = {"instruction_id_list": [instruction], "kwargs": [kwargs or {}]}
    return score("ifbench", response, None, meta)


ALPHABET = " ".join(f"{c.upper()}{c}{c} runs." for c in string.ascii_lowercase)

CASES = [
    # the classic IFEval ids (IFBench's classic_instructions.py)
    ("language:response_language", {"language": "en"},
     "This is a plain English sentence about the weather today.",
     "Ceci est une phrase en français sur le temps qu'il fait aujourd'hui."),
    ("language:response_language", {"language": "fr"},
     "Ceci est une phrase en français sur le temps qu'il fait aujourd'hui.",
     "This is a plain English sentence about the weather today."),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "I ran. You sat.", "I ran. You sat. We left."),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "at least"},
     "I ran! You sat? We left.", "I ran. You sat."),
    ("change_case:english_capital", {},
     "THIS IS A PLAIN ENGLISH SENTENCE ABOUT THE WEATHER TODAY.",
     "This is a plain English sentence about the weather today."),
    ("change_case:english_capital", {},  # all capitals, but not English
     "THIS IS A PLAIN ENGLISH SENTENCE ABOUT THE WEATHER TODAY.",
     "DAS IST EIN DEUTSCHER SATZ ÜBER DAS WETTER HEUTE UND MORGEN."),
    ("change_case:english_lowercase", {},
     "this is a plain english sentence about the weather today.",
     "this is a plain English sentence about the weather today."),
    ("change_case:english_lowercase", {},  # all lower case, but not English
     "this is a plain english sentence about the weather today.",
     "ceci est une phrase en français sur le temps qu'il fait aujourd'hui."),
    ("change_case:capital_word_frequency", {"capital_frequency": 2,
                                            "capital_relation": "at least"},
     "WE MUST go NOW.", "We MUST go now."),
    ("change_case:capital_word_frequency", {"capital_frequency": 2,
                                            "capital_relation": "less than"},
     "We MUST go now.", "WE MUST go now."),
    # IFBench's own (instructions.py)
    ("ratio:stop_words", {"percentage": 50}, "Cats chase mice quickly.",
     "It is the one of them."),
    ("ratio:sentence_type", {}, "I am here. You are there. Are we?", "I am here. Are you?"),
    ("ratio:sentence_balance", {}, "I ran. Did you? Wow!", "I ran. Did you? Wow! Yes."),
    ("sentence:alliteration_increment", {}, "Big bad bears. Silly snakes slither slowly.",
     "Silly snakes slither slowly. Big bad bears."),
    ("format:emoji", {}, "I love pizza 🍕. It is great 😀.", "I love pizza. It is great 😀."),
    ("format:emoji", {}, "I love pizza. 🍕 It is great 😀",  # the next sentence starts with one
     "I love pizza 🍕. It is great"),
    ("ratio:sentence_words", {}, "Cats nap. Dogs run. Owls fly.",
     "Cats nap. Dogs run. Owls soar."),
    ("sentence:keyword", {"word": "apple", "N": 2}, "I ran. I ate an Apple. Done.",
     "I ate an apple. I ran."),
    ("sentence:keyword", {"word": "apple", "N": 2}, "I ran. An apple!",
     "I ran. Pineapples!"),                                   # a whole word only
    ("count:pronouns", {"N": 3}, "She/her and they went.", "The cat sat on the mat with her."),
    ("words:odd_even_syllables", {}, "cat apple dog", "cat dog"),
    ("words:last_first", {}, "I like cats. Cats like me.", "I like cats. Dogs like me."),
    ("sentence:increment", {"small_n": 1}, "I ran. You ran fast. We all ran fast.",
     "I ran. You ran."),
    ("format:no_bullets_bullets", {}, "I came. I saw.\n* a\n* b", "I came.\n* a\n* b"),
    ("format:no_bullets_bullets", {}, "I came. I saw.\n* a\n* b",
     "I came. I saw.\n* a\n* b\nThe end."),                   # prose after the bullets
    ("custom:word_reverse", {}, "Eagle bald the saw I.", "I saw the bald eagle."),
    ("custom:sentence_alphabet", {}, ALPHABET, ALPHABET.rsplit(" Zzz", 1)[0]),
    ("custom:sentence_alphabet", {}, ALPHABET, ALPHABET.replace("Bbb", "Xbb")),
    ("words:keywords_specific_position", {"keyword": "blue", "n": 2, "m": 3},
     "I ran. The sky, blue and wide.", "I ran. The blue sky."),
    ("words:words_position", {"keyword": "very"}, "It very much is very good.",
     "It very much is good."),
    ("words:words_position", {"keyword": "very"}, "It very much is very good",  # no final stop
     "It very much is very."),
    ("format:title_case", {}, "The Quick Brown Fox Jumps.", "The quick Brown Fox."),
    ("format:title_case", {}, "An iPhone For NASA, 2024!", "A Dog Of a Friend"),  # "a" fails
]


@pytest.mark.parametrize("instruction,kwargs,good,bad", CASES)
def test_ifbench_nlp_checkers(instruction, kwargs, good, bad):
    assert ifbench(good, instruction, kwargs) == 1.0
    assert ifbench(bad, instruction, kwargs) == 0.0


def test_every_id_has_cases_and_only_the_pos_tagger_is_missing():
    assert {c[0] for c in CASES} == set(NLP)
    assert set(UNSUPPORTED) == {"words:start_verb"}  # NLTK's POS tagger: trained data only


def test_sentences_and_words_without_trained_data():
    # Punkt's algorithm untrained: breaks after . ? ! before white space ...
    assert sentences("One day. Two days? Three! four") == [
        "One day.", "Two days?", "Three!", "four"]
    # ... but knows no abbreviation: the English model would keep "Dr. Smith" in one sentence
    assert sentences("Dr. Smith left.") == ["Dr.", "Smith left."]
    assert ifbench("Dr. Smith left.", "length_constraints:number_sentences",
                   {"num_sentences": 2, "relation": "at least"}) == 1.0
    # word_tokenize: Treebank tokens per sentence; a sentence's final period splits off
    assert words("Don't stop. Go, now.") == ["Do", "n't", "stop", ".", "Go", ",", "now", "."]


def test_stop_words_are_the_ones_a_word_token_can_be():
    assert {"the", "ourselves", "don", "t", "wouldn"} <= STOP_WORDS
    assert not any("'" in w for w in STOP_WORDS)
    # "don't" is the \w+ tokens don + t, both stop words: 2 of 3 words
    assert ifbench("don't panic", "ratio:stop_words", {"percentage": 67}) == 1.0
    assert ifbench("don't panic", "ratio:stop_words", {"percentage": 66}) == 0.0


def test_undetectable_language_passes_as_in_ifbench():
    # langdetect finds no features in digits; IFBench's checker then returns True
    assert ifbench("12345", "language:response_language", {"language": "de"}) == 1.0


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "syllapy", None)  # import syllapy now raises ImportError
    with pytest.raises(ImportError, match=r"relax-slurm\[ifbench\]"):
        ifbench("cat apple", "words:odd_even_syllables")
