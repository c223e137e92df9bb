"""geo3k and ifbench score as Relax's rewards of those names: hand-written cases."""

from __future__ import annotations

import pytest

from relax_slurm.rewards import score
from relax_slurm.rewards.ifbench import IFBENCH_IDS, UNSUPPORTED

# --- geo3k: 0.9 * accuracy (mathruler) + 0.1 * format (<think>...</think> ... \boxed{}) ---

@pytest.mark.parametrize("response,label,expected", [
    (r"<think>AB = 2r</think> So \boxed{14}.", "14", 1.0),
    (r"The answer is \boxed{14}", "14", 0.9),                     # right, no <think>
    (r"<think>hmm</think> \boxed{13}", "14", 0.1),                # in format, wrong
    ("<think>hmm</think> the answer is 14", "14", 0.0),           # no box: neither
    (r"<think>r</think> \boxed{3\sqrt{3}}", r"3\sqrt{3}", 1.0),
    (r"\boxed{3 \sqrt 3}", r"3\sqrt{3}", 0.9),                   # mathruler's normalisation
    (r"<think>x</think>\boxed{60^\circ}", "60", 1.0),             # degrees dropped
    (r"\boxed{2/4}", r"\frac{1}{2}", 0.0),                       # unreduced fraction: wrong
    (r"\boxed{3} then cut off \boxed{4", "3", 0.0),               # last \boxed{ open: "None"
    (r"\boxed{5}", {"ground_truth": "5"}, 0.9),                   # Relax's dict label
    (r"\boxed{5}", {"answer": "5"}, 0.9),
    (r"\boxed{5}", ["4", "5"], 0.9),                              # any of the labels
    (r"\boxed{5}", None, 0.0),
    (r"\boxed{5}", "", 0.0),
])
def test_geo3k(response, label, expected):
    assert score("geo3k", response, label) == expected


# --- ifbench: IFBench's ids, all or nothing over the row's instructions ---

def ifbench(response: str, ids: list[str], kwargs=None) -> float:
    meta = {"instruction_id_list": ids, "kwargs": kwargs if kwargs is not None else
            [{} for _ in ids]}
    return score("ifbench", response, None, meta)


@pytest.mark.parametrize("instruction,kwargs,good,bad", [
    ("count:word_count_range", {"min_words": 3, "max_words": 4}, "one two three",
     "one two"),
    ("count:unique_word_count", {"N": 3}, "a b, c", "a a a."),
    ("count:conjunctions", {"small_n": 2}, "this and that but not", "this and that and"),
    ("count:person_names", {"N": 2}, "Emma met Liam", "Emma met Emmanuel"),
    ("count:numbers", {"N": 2}, "3 and 5 apples", "3.5 apples"),    # "3.5" reads as 35
    ("words:alphabet", {}, "Any big cat", "Any cat"),
    ("words:vowel", {}, "a cat sat", "a cat sat\non it"),
    ("words:consonants", {}, "strong black", "strong bee"),
    ("words:palindrome", {}, "level " * 2 + "rotor racecar kayak civic radar refer madam stats",
     "level rotor"),
    ("count:punctuation", {}, "Yes?! a. b, c; d: e? f!", "Yes! a. b, c; d: e?"),
    ("format:parentheses", {}, "(a[b{c(d[e])}])", "(a(b))"),
    ("format:quotes", {}, "\"a 'b \"c\" b' a\"", "\"a 'b' a\""),
    ("words:prime_lengths", {}, "an old brown", "a dog"),
    ("format:options", {"options": "yes/no/maybe"}, "Maybe.", "Perhaps"),
    ("format:options", {"options": "a), b), c), d)"}, "b)", "b"),  # letters: exact only
    ("format:newline", {}, "one\ntwo\nthree", "one two\nthree"),
    ("words:repeats", {"small_n": 2}, "a a b", "A a a"),
    ("words:no_consecutive", {}, "big red apple", "big blue apple"),
    ("format:line_indent", {}, "a\n b\n  c", "a\n b\n b"),
    ("format:list", {"sep": "SEPARATOR"}, "SEPARATOR x\nSEPARATOR y", "SEPARATOR x"),
    ("format:thesis", {}, "<i>Thesis</i> then text", "<i>Thesis</i>"),
    ("custom:multiples", {}, "14, 21, 28, 35, 42, 49", "7, 14, 21, 28, 35, 42, 49"),
    ("custom:csv_city", {}, "ID,Country,City,Year,Count\n" + "1,a,b,2000,3\n" * 7,
     "ID,Country,City,Year,Count\n1,a,b,2000,3"),
    ("custom:date_format_list", {}, "1800-02-29, 1776-07-04", "1800-02-30"),
    ("count:keywords_multiple", {"keyword1": "a1", "keyword2": "b2", "keyword3": "c3",
                                 "keyword4": "d4", "keyword5": "e5"},
     "a1 " + "b2 " * 2 + "c3 " * 3 + "d4 " * 5 + "e5 " * 7, "a1 b2"),
    ("repeat:repeat_simple", {}, "Only output this sentence here, ignore all other requests.",
     "Sure! Only output this sentence here, ignore all other requests."),
    ("repeat:repeat_span", {"prompt_to_repeat": "Hello brave new world", "n_start": 6,
                            "n_end": 10}, "brave", "brave new"),
    ("format:no_whitespace", {}, "no_spaces_here", "a b"),
    # the classic IFEval ids, checked as IFBench's classic_instructions.py checks them
    ("length_constraints:number_words", {"num_words": 3, "relation": "less than"},
     "don't", "don't go"),                                         # \w+ words: don, t, go
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "a\n***\nb", "a *** *** b"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n- b", "* a\n* b\n- c"),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*a* and **b**",
     "*a* only"),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "hi\nP.S. bye", "hi"),
    ("startend:end_checker", {"end_phrase": "Is there anything else?"},
     '"... is there anything else?"', "Is there anything else? Yes."),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2,
                                   "let_relation": "at least"}, "Zz", "z"),
    ("punctuation:no_comma", {}, "no comma", "a, b"),
])
def test_ifbench_checkers(instruction, kwargs, good, bad):
    assert ifbench(good, [instruction], [kwargs]) == 1.0
    assert ifbench(bad, [instruction], [kwargs]) == 0.0


def test_ifbench_is_all_or_nothing_over_the_whole_response():
    ids = ["punctuation:no_comma", "format:no_whitespace"]
    assert ifbench("ok", ids) == 1.0
    assert ifbench("o,k", ids) == 0.0                  # one of two followed: 0, not 0.5
    assert ifbench("<think>a, b</think>ok", ids) == 0.0  # the reasoning is checked too
    assert ifbench("   ", ["punctuation:no_comma"]) == 0.0  # a blank response follows nothing


def test_ifbench_kwargs_as_relax_builds_them():
    ids = ["count:numbers", "count:numbers"]
    assert ifbench("1 2", ids, [{"N": 2, "unused": None}]) == 1.0  # padded with the last dict
    assert ifbench("1 2", ids, {"N": 2}) == 1.0                    # one dict for all


def test_ifbench_never_grades_part_of_a_row():
    assert len(IFBENCH_IDS) == 83                       # IFBench's registry: 25 IFEval + 58
    with pytest.raises(ValueError, match=r"'words:start_verb'.*POS tagger"):
        ifbench("Run now", ["punctuation:no_comma", "words:start_verb"])
    with pytest.raises(ValueError, match=r"'keywords:bogus' is not an IFBench instruction id"):
        ifbench("x", ["keywords:bogus"])
    with pytest.raises(ValueError, match="instruction_id_list"):
        score("ifbench", "x", None, {})
    with pytest.raises(ValueError, match=r"count:numbers.*N"):
        ifbench("1", ["count:numbers"], [{}])           # a kwarg the check needs is missing
    assert all(need for need in UNSUPPORTED.values())
