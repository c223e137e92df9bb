"""Each estimator's parameters are typed and built when the `algo` section is validated: a
wrong type names the field there, not at the first step."""

from dataclasses import dataclass, fields

import pytest
import torch

from relax_slurm.algos import compute_advantages, names, policy_loss
from relax_slurm.algos.grpo import group_advantages
from relax_slurm.config.algo import ALGO_NAMES, AlgoConfig
from relax_slurm.config.algo_params import (
    PARAMS_OF, ClipParams, GroupParams, SapoParams, params_of,
)
from relax_slurm.errors import ConfigError


def test_every_algorithm_declares_parameters_the_algo_section_has():
    assert set(PARAMS_OF) == set(names()) == set(ALGO_NAMES)
    algo_fields = {f.name for f in fields(AlgoConfig)}
    for name, classes in PARAMS_OF.items():
        for cls in classes:
            assert {f.name for f in fields(cls)} <= algo_fields, (name, cls)
        # and every preset's section builds them (each algo's defaults here)
        assert type(AlgoConfig(name=name).estimator_params().loss) is classes[1]


def test_a_wrong_type_is_refused_when_the_section_is_validated_naming_the_field():
    with pytest.raises(ConfigError, match=r"algo\.std_normalize='yes': algo=grpo reads it as "
                                          r"<class 'bool'> \(GroupParams\)"):
        AlgoConfig(name="grpo", std_normalize="yes")
    # the same field means nothing to rloo's estimator: not read, not refused
    assert AlgoConfig(name="rloo", std_normalize="yes").estimator_params().advantages is not None


def test_a_field_an_estimator_reads_that_the_section_lacks_is_named():
    @dataclass(frozen=True, kw_only=True)
    class Needs:
        eps_clip: float
        warp_factor: float

    with pytest.raises(ConfigError, match=r"algo\.warp_factor: algo=grpo reads it \(Needs\) but "
                                          "it was not given"):
        params_of(Needs, "grpo", AlgoConfig())


def test_direct_calls_take_keywords_typed_the_same_way():
    r = torch.tensor([[1.0, 0.0]])
    typed = group_advantages(r, GroupParams(std_normalize=False))
    assert torch.equal(compute_advantages("grpo", r, std_normalize=False), typed)
    with pytest.raises(ConfigError, match=r"algo\.std_normalize=1"):
        compute_advantages("grpo", r, std_normalize=1)
    with pytest.raises(ConfigError, match=r"algo\.tau_pos='hot'.*SapoParams"):
        policy_loss("sapo", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),
                    torch.ones(1, 2), tau_pos="hot")


def test_the_trainers_typed_params_give_what_keywords_give_and_refuse_both():
    """The trainer builds `estimator_params()` once and passes it; a direct call's keywords
    build the same object per call, so either gives the same numbers."""
    r = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.2, 0.9]])
    logp, old = torch.tensor([[-1.0, -0.5, -2.0]]), torch.tensor([[-1.2, -0.1, -2.0]])
    adv, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    for name in names():
        cfg = AlgoConfig(name=name, std_normalize=False, eps_clip=0.1, tau_pos=2.0)
        p = cfg.estimator_params()
        knobs = {"std_normalize": False, "eps_clip": 0.1, "tau_pos": 2.0}
        assert torch.equal(compute_advantages(name, r, p),
                           compute_advantages(name, r, **knobs)), name
        teacher = {"teacher_logprobs": old - 0.3} if name == "opd" else {}
        typed, _ = policy_loss(name, logp, old, adv, mask, params=p, **teacher)
        keyed, _ = policy_loss(name, logp, old, adv, mask, **knobs, **teacher)
        assert torch.equal(typed, keyed), name
    with pytest.raises(TypeError, match=r"not both \(got params and \['eps_clip'\]\)"):
        policy_loss("grpo", logp, old, adv, mask, params=p, eps_clip=0.3)
    with pytest.raises(TypeError, match="not both"):
        compute_advantages("grpo", r, AlgoConfig().estimator_params(), std_normalize=False)


def test_params_are_the_section_values():
    cfg = AlgoConfig(name="gspo", eps_clip=3e-4, eps_clip_high=4e-4)
    assert cfg.estimator_params().loss == ClipParams(eps_clip=3e-4, eps_clip_high=4e-4)
    assert AlgoConfig(name="sapo", tau_neg=2.0).estimator_params().loss == SapoParams(
        tau_pos=1.0, tau_neg=2.0)
