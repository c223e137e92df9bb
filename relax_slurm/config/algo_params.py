"""Each estimator's parameters, typed: the `algo.*` fields its advantage function and its token
loss read (relax_slurm/algos/), as frozen dataclasses.

Built from the `algo` section when it is validated (`AlgoConfig.__post_init__`), so a value of
the wrong type, or a field an estimator reads that the section lacks, fails there naming
`algo.<field>` instead of at the first training step; the functions in algos/ take these
objects, not a bag of keywords. Torch-free, like the rest of config/.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import Any, Optional, get_args, get_type_hints

from relax_slurm.config.check import check


@dataclass(frozen=True, kw_only=True)
class NoParams:
    """An estimator or loss with no knob of its own."""


@dataclass(frozen=True, kw_only=True)
class GroupParams:
    """Group-relative advantages (grpo and the estimators built on it)."""

    std_normalize: bool


@dataclass(frozen=True, kw_only=True)
class ClipParams:
    """PPO's clipped objective, per token or per sequence (gspo)."""

    eps_clip: float
    eps_clip_high: Optional[float] = None
    eps_clip_c: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class CispoParams:
    """CISPO's clipped importance weight."""

    eps_clip: float
    eps_clip_high: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class SapoParams:
    """SAPO's soft gate temperatures."""

    tau_pos: float
    tau_neg: float


@dataclass(frozen=True)
class EstimatorParams:
    advantages: Any
    """The advantage function's parameters."""
    loss: Any
    """The token loss's parameters."""


# algo.name -> (advantage parameters, token-loss parameters); every name of ALGO_NAMES (a unit
# test checks it against the registry in relax_slurm/algos/)
PARAMS_OF: dict[str, tuple[type, type]] = {
    "grpo": (GroupParams, ClipParams), "dapo": (GroupParams, ClipParams),
    "opd": (GroupParams, ClipParams), "gspo": (GroupParams, ClipParams),
    "cispo": (GroupParams, CispoParams), "sapo": (GroupParams, SapoParams),
    "rloo": (NoParams, ClipParams), "reinforce_plus_plus": (NoParams, ClipParams),
    "reinforce_plus_plus_baseline": (NoParams, ClipParams), "ppo": (NoParams, ClipParams),
    "sft": (NoParams, NoParams),
}


def _accepts(hint: Any, value: Any) -> bool:
    """Whether `value` fits a field typed `hint` (bool, float, Optional[float] here); an int
    passes for a float, a bool never for a number."""
    args = get_args(hint)
    if value is None:
        return type(None) in args
    base = next(a for a in args if a is not type(None)) if args else hint
    if base is bool:
        return isinstance(value, bool)
    assert base is float, f"no check for parameters typed {hint}"
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def params_of(cls: type, name: str, values: Mapping[str, Any] | Any) -> Any:
    """`cls` built from `values` (a mapping, or an object with the fields as attributes: the
    `algo` section); ConfigError naming `algo.<field>` for a missing one or a wrong type."""
    hints = _hints(cls)
    kwargs = {}
    for f in fields(cls):
        has = f.name in values if isinstance(values, Mapping) else hasattr(values, f.name)
        if not has:
            check(f.default is not MISSING,
                  f"algo.{f.name}: algo={name} reads it ({cls.__name__}) but it was not given")
            continue
        value = values[f.name] if isinstance(values, Mapping) else getattr(values, f.name)
        check(_accepts(hints[f.name], value),
              f"algo.{f.name}={value!r}: algo={name} reads it as {hints[f.name]} "
              f"({cls.__name__})")
        kwargs[f.name] = value
    return cls(**kwargs)


def estimator_params(name: str, values: Mapping[str, Any] | Any) -> EstimatorParams:
    """The typed parameters of algorithm `name` from `values` (the `algo` section, or keywords
    of a direct call)."""
    check(name in PARAMS_OF, f"algo.name={name!r}: no parameters declared for it "
          "(relax_slurm/config/algo_params.py PARAMS_OF)")
    adv_cls, loss_cls = PARAMS_OF[name]
    return EstimatorParams(advantages=params_of(adv_cls, name, values),
                           loss=params_of(loss_cls, name, values))
