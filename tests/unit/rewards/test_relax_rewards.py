"""geo3k, ifbench and dapo-genrm score as Relax's rewards of those names: hand-written cases.

The judge of dapo-genrm is a real HTTP server of the test's own (tests/helpers_http.py),
answering in the shape of an engine's /generate.
"""

from __future__ import annotations


import pytest

from relax_slurm.config.reward import RewardConfig
from relax_slurm.errors import ConfigError
from relax_slurm.rewards import RewardError, RewardInput, build_reward, score
from relax_slurm.rewards.dapo_genrm import DAPO_TEMPLATE, judge_prompt
from relax_slurm.rewards.ifbench import IFBENCH_IDS, UNSUPPORTED
from tests.helpers_http import Server, judge_engine

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
    ("count:word_count_range", {"min_words": 2, "max_words": 2}, "go \ufe0f", "go"),  # NLTK 3.10:
    # its \w (regex engine) takes an emoji's variation selector as a word
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


# --- dapo-genrm: Relax's judge on every response; dapo_rule_genrm: the rule first ---

def dapo_cfg(server: Server, name: str = "dapo-genrm") -> RewardConfig:
    return RewardConfig(name=name, genrm_url=server.url, genrm_max_new_tokens=16,
                        genrm_temperature=0.1, genrm_timeout_s=5.0, timeout_s=10.0)


INP = RewardInput(prompt="What is 6*7?", label="42",
                  response="<think>6*7 is 42</think> I am sure.\nAnswer: $42$")


def test_dapo_genrm_asks_the_judge_with_relaxs_prompt(serve):
    server = serve(judge_engine(" 1\n"))
    assert build_reward(dapo_cfg(server))(INP) == 1.0
    path, body = server.requests[0]
    assert path == "/generate"
    assert body["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.1}
    assert body["text"] == (DAPO_TEMPLATE.replace("{prompt}", "What is 6*7?")
                            .replace("{label}", "42").replace("{response}", " $42$"))
    assert body["text"].endswith("[Model_answer] :  $42$\nJudgement:")


@pytest.mark.parametrize("answer", ["0", "1.", "10", "Yes", "1 because 42 = 42"])
def test_dapo_genrm_pays_only_an_exact_one(serve, answer):
    server = serve(judge_engine(answer))
    assert build_reward(dapo_cfg(server))(INP) == 0.0


def test_dapo_genrm_reads_the_tail_and_the_metadata(serve):
    server = serve(judge_engine("1"))
    long = "x" * 500 + " so it is 42"                         # no "Answer:": last 300 chars
    inp = RewardInput(prompt="rendered", response=long, label="ignored",
                      metadata={"question": "Q?", "label": "42"})
    assert build_reward(dapo_cfg(server))(inp) == 1.0
    text = server.requests[0][1]["text"]
    assert "[Question]: Q?\n[Standard Answer]: 42\n" in text
    assert f"[Model_answer] : {long[-300:]}\nJudgement:" in text
    assert judge_prompt("{label}", RewardInput(prompt="", response="", label=["1", "2"])) \
        == "1 or 2"


def test_dapo_genrm_calls_the_judge_even_for_a_right_rule_answer(serve):
    server = serve(judge_engine("0"))
    assert build_reward(dapo_cfg(server))(INP) == 0.0          # Relax: the judge decides
    assert len(server.requests) == 1


def test_dapo_rule_genrm_asks_the_judge_only_when_the_rule_cannot_confirm(serve):
    server = serve(judge_engine("1"))
    reward = build_reward(dapo_cfg(server, "dapo_rule_genrm"))
    assert reward(INP) == 1.0 and server.requests == []        # the rule found 42
    pink = RewardInput(prompt="Colour?", label="pink", response="Answer: it is pink")
    assert reward(pink) == 1.0 and len(server.requests) == 1  # the rule says no: the judge
    assert server.requests[0][1]["text"].endswith("[Model_answer] :  it is pink\nJudgement:")
    no_line = RewardInput(prompt="", label="42", response=r"\boxed{42}")
    assert reward(no_line) == 1.0 and len(server.requests) == 2


def test_dapo_genrm_failures_are_errors(serve):
    broken = serve(lambda path, body: (500, {"error": "oom"}))
    with pytest.raises(RewardError, match="HTTP 500"):
        build_reward(dapo_cfg(broken))(INP)
    with pytest.raises(ConfigError, match="genrm_url"):
        build_reward(RewardConfig(name="dapo-genrm"))
    with pytest.raises(ConfigError, match="genrm_timeout_s"):
        RewardConfig(name="dapo-genrm", genrm_timeout_s=120.0, timeout_s=60.0)
