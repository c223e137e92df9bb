"""Rewards: registry lookup, exact_match, math, and every reward module's doctests."""

from __future__ import annotations

import doctest

import pytest

from relax_slurm.errors import ConfigError
from relax_slurm.rewards import RewardInput, get_reward_fn, register, registered_names
from relax_slurm.rewards import dapo, dapo_genrm, deepscaler, extract, f1, genrm, geo3k, ifbench
from relax_slurm.rewards import ifbench_checks, ifeval, multiple_choice
from relax_slurm.rewards import exact_match as exact_match_module
from relax_slurm.rewards import math as math_module
from relax_slurm.rewards import openr1mm, prefix_match, registry, remote


def inp(response: str, label, finish_reason: str = "stop") -> RewardInput:
    return RewardInput(prompt="", response=response, label=label, finish_reason=finish_reason)


@pytest.mark.parametrize("module", [
    exact_match_module, math_module, registry, extract, dapo, deepscaler, multiple_choice, f1,
    ifeval, remote, genrm, openr1mm, geo3k, ifbench, ifbench_checks, dapo_genrm, prefix_match,
], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_doctests(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_registry_lookup():
    assert {"exact_match", "math"} <= set(registered_names())
    assert get_reward_fn("exact_match") is exact_match_module.exact_match
    assert get_reward_fn("relax_slurm.rewards.math:math_reward") is math_module.math_reward


def test_unknown_name_lists_names_and_dotted_path():
    with pytest.raises(ConfigError) as e:
        get_reward_fn("exact_mach")
    msg = str(e.value)
    assert "exact_match" in msg and "math" in msg and "package.module:function" in msg


@pytest.mark.parametrize("path", ["no_such_module_xyz:f", "relax_slurm.rewards.math:nope"])
def test_bad_dotted_path(path):
    with pytest.raises(ConfigError, match="reward.name"):
        get_reward_fn(path)


def test_register_custom_reward():
    try:
        @register("test_length")
        def length(x: RewardInput) -> float:
            return float(len(x.response))

        assert get_reward_fn("test_length")(inp("abc", None)) == 3.0
        with pytest.raises(ValueError, match="already registered"):
            register("test_length")(lambda x: 0.0)
    finally:
        registry._REGISTRY.pop("test_length", None)


@pytest.mark.parametrize("response,label,finish,want", [
    ("7", "7", "stop", 1.0),
    (" 7\n", 7, "stop", 1.0),
    ("7", "7", "length", 0.0),  # must stop by itself
    ("77", "7", "stop", 0.0),
    ("", "7", "stop", 0.0),
])
def test_exact_match(response, label, finish, want):
    assert get_reward_fn("exact_match")(inp(response, label, finish)) == want


@pytest.mark.parametrize("response,label,want", [
    (r"so \boxed{42}", "42", 1.0),
    (r"\boxed{\frac{1}{2}}", r"\dfrac{1}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}", 1.0),  # nested braces
    (r"first \boxed{1}, finally \boxed{2}", "2", 1.0),  # the last box counts
    (r"\boxed{ $1,000$ }", "1000", 1.0),
    (r"\boxed{7.0}", 7, 1.0),
    (r"\boxed{0.50}", "0.5", 1.0),
    ("the answer is 12.", "12", 1.0),  # no box: the final number
    ("3 apples and -4 pears", "-4", 1.0),
    ("1,234,567 in total", "1234567", 1.0),
    (r"\boxed{8}", "7", 0.0),
    (r"\boxed{1/2}", "0.5", 1.0),  # symbolic equivalence (math-verify)
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{1/3}", "0.33", 0.0),
    ("I do not know", "7", 0.0),
    (r"the label may be boxed too: 5", r"\boxed{5}", 1.0),
])
def test_math(response, label, want):
    assert get_reward_fn("math")(inp(response, label)) == want


def test_rewards_are_floats():
    for name in ("exact_match", "math"):
        assert type(get_reward_fn(name)(inp("7", "7"))) is float
