"""Each built-in reward's rule on edge cases, and the public contract score() / names()."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import yaml

from relax_slurm.config.reward import RewardConfig
from relax_slurm.errors import ConfigError
from relax_slurm.rewards import (
    RewardError, RewardInput, Scorer, build_reward, get_reward_fn, names, register,
    reward_workers, score, traits,
)
from relax_slurm.rewards import registry
from relax_slurm.rewards.extract import last_boxed

CONF_REWARD = Path(__file__).resolve().parents[3] / "conf" / "reward"
BUILT_IN = ["dapo", "deepscaler", "exact_match", "f1", "genrm", "gpqa", "gpqa_strict", "ifeval",
            "math", "multiple_choice", "remote"]
LONG = "Let me think about this step by step. " * 5000  # ~190k characters


def test_names_and_yaml_per_reward():
    assert set(names()) >= set(BUILT_IN)
    for name in BUILT_IN:
        data = yaml.safe_load((CONF_REWARD / f"{name}.yaml").read_text())
        assert data["name"] == name and data["defaults"] == ["base_reward"]
        RewardConfig(**{k: v for k, v in data.items() if k != "defaults"})


# ---- math family ------------------------------------------------------------------------------

@pytest.mark.parametrize("response,label,want", [
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),                    # LaTeX fraction vs decimal
    (r"\boxed{\frac34}", r"\frac{3}{4}", 1.0),                 # brace-less \frac
    (r"\boxed{1} hmm, no: \boxed{2} and finally \boxed{3}", "3", 1.0),  # several boxes: last
    (r"\boxed{1} hmm, no: \boxed{2} and finally \boxed{3}", "1", 0.0),
    (r"ответ: \boxed{42} ✓", "42", 1.0),                        # unicode around the answer
    ("", "1", 0.0),                                            # empty response
    ("no digits at all", "1", 0.0),                            # no answer
    (LONG + r"\boxed{17}", "17", 1.0),                         # very long output
    (LONG, "17", 0.0),
    (r"\boxed{5}", ["five", "5"], 1.0),                        # a list of acceptable labels
])
def test_math_edge_cases(response, label, want):
    assert score("math", response, label) == want


def test_last_boxed_is_linear_on_adversarial_input():
    text = r"\boxed{" * 20000 + "x"  # 20k unclosed boxes: quadratic scanning would take minutes
    start = time.perf_counter()
    assert last_boxed(text) is None
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("response,label,want", [
    ("Reasoning...\nAnswer: 42", "42", 1.0),
    ("Reasoning...\nanswer:  $\\frac{1}{2}$.", "0.5", 1.0),
    ("Answer: 7\nWait.\nAnswer: 8", "8", 1.0),          # the last Answer: line
    ("Reasoning...\nAnswer: 41", "42", -1.0),
    (r"\boxed{42}", "42", -1.0),                         # no Answer: line
    ("Answer: 42" + LONG, "42", -1.0),                   # only the tail is searched
])
def test_dapo(response, label, want):
    assert score("dapo", response, label) == want


@pytest.mark.parametrize("response,label,want", [
    (r"<think>maybe \boxed{3}</think>So \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"<think>maybe \boxed{3}</think>So 3", "3", 0.0),   # box only inside the reasoning
    (r"\boxed{3}", "3", 0.0),                            # no </think>
    (r"<think>a</think>\boxed{1}</think>\boxed{2}", "2", 1.0),  # after the last </think>
])
def test_deepscaler(response, label, want):
    assert score("deepscaler", response, label) == want


# ---- multiple choice, f1, ifeval --------------------------------------------------------------

@pytest.mark.parametrize("response,label,meta,want", [
    (r"... so \boxed{C}", "C", None, 1.0),
    (r"\boxed{\text{(c)}}", "(C)", None, 1.0),
    ("The answer is **B**.", "B", None, 1.0),
    ("Answer: $D$", "d", None, 1.0),
    ("A", "A", None, 1.0),
    ("Between (A) and (C), I'd say (C)", "C", None, 1.0),
    ("I pick B", "B", None, 0.0),                          # no recognisable pick
    ("The answer is B", "Paris", {"choices": ["Rome", "Paris"]}, 1.0),
    ("The answer is C", "C", {"choices": ["x", "y"]}, 0.0),  # C is not an option
    ("<think>answer is A</think>answer is B", "B", None, 1.0),
])
def test_multiple_choice(response, label, meta, want):
    assert score("multiple_choice", response, label, meta) == want


@pytest.mark.parametrize("response,label,want", [
    ("Reasoning\nAnswer: B", "B", 1.0),
    ("Answer: (B)", "B", 1.0),
    (r"\boxed{B}", "B", 1.0),
    ("The answer is B", "B", 0.0),  # strict format
    ("Answer: A\nAnswer: B", "A", 0.0),
])
def test_gpqa_strict(response, label, want):
    assert score("gpqa_strict", response, label) == want


@pytest.mark.parametrize("response,label,meta,want", [
    ("The answer is (C).", "C", None, 1.0),          # Relax: "the answer is (X)" counts
    ("Answer: (B)", "B", None, 1.0),
    (r"\boxed{B}", "B", None, 1.0),
    ("A is tempting, B is right... final: D", "D", None, 1.0),  # last standalone letter
    ("Between A and B I choose E", "B", None, 1.0),  # E is not valid: the last valid is B
    ("no letter here", "A", None, 0.0),
    ("The answer is C", 2, None, 1.0),               # label: a 0-based index
    ("The answer is C", "2", None, 1.0),
    ("The answer is B", "Paris", {"choices": ["Rome", "Paris", "Oslo", "Bern"]}, 1.0),
    ("Answer: E", "?", {"valid_letters": "ABCDE", "correct_letter": "E"}, 1.0),
    ("Answer: E", "E", None, 0.0),                   # A-D unless valid_letters says more
    ("Answer: (c)", "x", {"correct_letter": "(C)"}, 1.0),
])
def test_gpqa_scores_as_relax(response, label, meta, want):
    assert score("gpqa", response, label, meta) == want


@pytest.mark.parametrize("response,label,want", [
    ("Denver Broncos", "Denver Broncos", 1.0),
    ("the Denver Broncos!", "Denver Broncos", 1.0),          # articles and punctuation
    ("Broncos", "Denver Broncos", 2 * (1.0 * 0.5) / 1.5),    # P = 1, R = 1/2
    ("Carolina Panthers", "Denver Broncos", 0.0),
    ("Zürich", ["Zurich", "zürich"], 1.0),                   # unicode, best of several
    ("", "Denver", 0.0),
])
def test_f1(response, label, want):
    assert score("f1", response, label) == pytest.approx(want)


def ifeval_meta(*pairs):
    return {"instruction_id_list": [p[0] for p in pairs], "kwargs": [p[1] for p in pairs]}


@pytest.mark.parametrize("response,pairs,want", [
    ("one two three four", [("length_constraints:number_words",
                             {"num_words": 3, "relation": "at least"})], 1.0),
    ("one two", [("length_constraints:number_words",
                  {"num_words": 3, "relation": "less than"})], 1.0),
    ("hi, there", [("punctuation:no_comma", {}), ("change_case:english_lowercase", {})], 0.5),
    ("<<Title>>\n* a\n* b", [("detectable_format:title", {}),
                             ("detectable_format:number_bullet_lists", {"num_bullets": 2})], 1.0),
    ('```json\n{"a": 1}\n```', [("detectable_format:json_format", {})], 1.0),
    ("{not json", [("detectable_format:json_format", {})], 0.0),
    ("p1 *** p2 *** p3", [("length_constraints:number_paragraphs", {"num_paragraphs": 3})], 1.0),
    ("Hello.\nP.S. bye", [("detectable_content:postscript", {"postscript_marker": "P.S."})], 1.0),
    ("I love cats", [("keywords:forbidden_words", {"forbidden_words": ["cat"]}),
                     ("keywords:existence", {"keywords": ["LOVE"]})], 1.0),
    ('"quoted"', [("startend:quotation", {}), ("keywords:letter_frequency",
                  {"letter": "o", "let_frequency": 1, "let_relation": "less than"})], 0.5),
    ("ÉCOLE ÉTÉ", [("change_case:english_capital", {"num_words": None})], 1.0),  # None ignored
])
def test_ifeval(response, pairs, want):
    assert score("ifeval", response, None, ifeval_meta(*pairs)) == want


def test_ifeval_errors_are_loud():
    with pytest.raises(ValueError, match="instruction_id_list"):
        score("ifeval", "text", None, {})
    with pytest.raises(ValueError, match="not supported"):
        score("ifeval", "text", None, ifeval_meta(("language:response_language", {})))


# ---- registry: score(), rm_type, boxed_, Scorer -----------------------------------------------

def test_rm_type_overrides_the_run_reward():
    assert score("exact_match", r"\boxed{7} is it", "7") == 0.0
    assert score("exact_match", r"\boxed{7} is it", "7", {"rm_type": "math"}) == 1.0


def test_boxed_prefix_grades_the_box_content():
    assert score("boxed_exact_match", r"The answer is \boxed{Paris}.", "Paris") == 1.0
    assert score("boxed_exact_match", "The answer is Paris", "Paris") == 0.0  # no box
    assert score("boxed_f1", r"\boxed{Denver Broncos} beat Carolina", "Denver Broncos") == 1.0
    with pytest.raises(ConfigError, match="boxed_"):
        get_reward_fn("boxed_nope")


def test_score_passes_finish_reason_and_prompt():
    assert score("exact_match", "7", "7", finish_reason="length") == 0.0


def test_scorer_is_picklable_and_checks_the_value():
    scorer = pickle.loads(pickle.dumps(build_reward(RewardConfig(name="math"))))
    assert scorer(RewardInput(prompt="", response=r"\boxed{2}", label="2")) == 1.0
    try:
        register("test_nan")(lambda inp: float("nan"))
        register("test_text")(lambda inp: "high")
        with pytest.raises(RewardError, match="nan"):
            Scorer("test_nan")(RewardInput(prompt="", response="", label=None))
        with pytest.raises(RewardError, match="not a number"):
            Scorer("test_text")(RewardInput(prompt="", response="", label=None))
    finally:
        registry._REGISTRY.pop("test_nan", None)
        registry._REGISTRY.pop("test_text", None)


@pytest.mark.parametrize("name,key", [("remote", "reward.remote_url"),
                                      ("genrm", "reward.genrm_url")])
def test_server_rewards_need_their_url(name, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_reward(RewardConfig(name=name, timeout_s=200.0))


@pytest.mark.parametrize("overrides,key", [
    ({"num_workers": -1}, "reward.num_workers"),  # 0 is valid: scored inline
    ({"timeout_s": 0.0}, "reward.timeout_s"),
    ({"genrm_parser": "stars"}, "reward.genrm_parser"),
    ({"name": "genrm", "timeout_s": 10.0}, "reward.timeout_s"),
])
def test_bad_reward_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        RewardConfig(**overrides)


@pytest.mark.parametrize("name,workers", [("exact_match", 0), ("prefix_match", 0), ("math", 4),
                                          ("genrm", 4), ("f1", 4), ("boxed_exact_match", 0),
                                          ("my_package.my_module:my_reward", 4)])
def test_num_workers_null_scores_pure_rules_inline_and_the_rest_in_workers(name, workers):
    # inline for the microsecond rules only: a judge called on the worker's event loop would
    # stall every generation for the length of each call
    assert reward_workers(RewardConfig(name=name, timeout_s=200.0)) == workers
    assert reward_workers(RewardConfig(name=name, timeout_s=200.0, num_workers=2)) == 2


@pytest.mark.parametrize("name", ["remote", "genrm", "dapo-genrm", "dapo_rule_genrm",
                                  "boxed_genrm"])
def test_a_reward_that_waits_on_a_service_is_never_scored_inline(name):
    with pytest.raises(ConfigError, match=rf"reward\.num_workers=0 with reward\.name={name}: "
                                          "it waits on a service"):
        reward_workers(RewardConfig(name=name, num_workers=0, timeout_s=200.0))


def test_how_a_reward_is_scored_is_declared_where_it_is_registered():
    declared = {n: traits(n) for n in names()}
    assert {n for n, t in declared.items() if t.inline} == {"exact_match", "prefix_match"}
    assert {n for n, t in declared.items() if t.service} == {
        "remote", "genrm", "dapo-genrm", "dapo_rule_genrm"}
    assert traits("no.such:reward") == registry.Traits()
    with pytest.raises(ValueError, match="exclude each other"):
        registry.register("both_ways", inline=True, service=True)(lambda inp: 0.0)
    assert "both_ways" not in names()
