r"""Rewards by name: `@register("name")` on a function, `get_reward_fn(name)` to look it up.

A reward is a plain callable `fn(inp: RewardInput) -> float`: strings in, a number out, no I/O
(except `remote` and `genrm`, which call a server). A reward that needs settings (a URL) is
registered as a factory `make(cfg: RewardConfig) -> RewardFn` with `@register_factory`.
How a reward is scored is declared where it is registered and read by `reward_workers`, which
resolves `reward.num_workers` (the launcher checks it before anything starts): `inline=True`, a
pure rule of microseconds, scored in the rollout worker's process by default; `service=True`, a
reward that waits on a server, never scored there (it would stall all generation).
A name is:
- a registered reward or factory (`names()`);
- `boxed_<name>`: grades only the content of the response's last `\boxed{}` with `<name>`
  (0 when there is no complete box);
- your own: a dotted path `package.module:function`, or `path/to/file.py:function`
  (relax_slurm/user_code.py).
`Scorer(name, cfg)` is the picklable reward of a run: it uses `reward.name`, or a sample's
`metadata["rm_type"]` when set. `score(name, response, label, metadata)` scores one response.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from relax_slurm import user_code
from relax_slurm.errors import ConfigError, RelaxError
from relax_slurm.rewards.extract import last_boxed

BOXED_PREFIX = "boxed_"


class RewardError(RelaxError):
    """A reward could not score a response (server down, unparseable judge output, ...)."""


@dataclass(kw_only=True)
class RewardInput:
    """Everything a reward sees about one response."""

    prompt: str
    """The rendered prompt text."""
    response: str
    """The decoded response, special tokens skipped."""
    label: Any
    """The reference answer from the dataset row (`data.label_key`)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's metadata (`data.metadata_key`), or empty."""
    finish_reason: str = "stop"
    """'stop' when the model ended with EOS or a stop string, 'length' when truncated."""


RewardFn = Callable[[RewardInput], float]
RewardFactory = Callable[[Any], RewardFn]

_REGISTRY: dict[str, RewardFn] = {}
_FACTORIES: dict[str, RewardFactory] = {}
# reward.num_workers when null: the worker pool's size, or 0 (the worker's own process)
DEFAULT_WORKERS = 4


@dataclass(frozen=True)
class Traits:
    """How a reward is scored, declared with `register`/`register_factory`."""

    inline: bool = False
    """A pure rule of microseconds a response: scored in the rollout worker's own process
    unless reward.num_workers says otherwise (the pool's pickling and pipe round trips cost
    ~50 us a response, ~30 ms a step of the tiny task against ~1 ms inline)."""
    service: bool = False
    """Waits on a service (HTTP) for every response: scored inline it would stall the rollout
    worker's event loop, and with it all generation, for every call."""


_TRAITS: dict[str, Traits] = {}


def _add_traits(name: str, inline: bool, service: bool) -> None:
    if inline and service:
        raise ValueError(f"reward {name!r}: inline (a microsecond rule) and service (waits on "
                         "a server) exclude each other")
    _TRAITS[name] = Traits(inline=inline, service=service)


def register(name: str, *, inline: bool = False, service: bool = False
             ) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward under `name`; names are unique. `inline`, `service`: see
    `Traits`."""

    def add(fn: RewardFn) -> RewardFn:
        if (name in _REGISTRY and _REGISTRY[name] is not fn) or name in _FACTORIES:
            raise ValueError(f"reward {name!r} is already registered by "
                             f"{_REGISTRY.get(name) or _FACTORIES[name]!r}")
        _add_traits(name, inline, service)
        _REGISTRY[name] = fn
        return fn

    return add


def register_factory(name: str, *, service: bool = False
                     ) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator adding a reward built from the reward config: `make(cfg) -> RewardFn`;
    `service`: see `Traits`."""

    def add(make: RewardFactory) -> RewardFactory:
        if name in _REGISTRY or (name in _FACTORIES and _FACTORIES[name] is not make):
            raise ValueError(f"reward {name!r} is already registered")
        _add_traits(name, False, service)
        _FACTORIES[name] = make
        return make

    return add


def traits(name: str) -> Traits:
    """A reward name's traits: a registered one's, `boxed_<name>`'s those of `<name>` (the box
    is cut out in microseconds), a dotted path's none (nothing is known of it)."""
    if name.startswith(BOXED_PREFIX) and name not in _TRAITS:
        return traits(name[len(BOXED_PREFIX):])
    return _TRAITS.get(name, Traits())


def reward_workers(cfg: Any) -> int:
    """reward.num_workers resolved: null is 0 for an inline reward, else DEFAULT_WORKERS;
    ConfigError for 0 with a reward that waits on a service."""
    t = traits(cfg.name)
    workers = cfg.num_workers
    if workers is None:
        workers = 0 if t.inline else DEFAULT_WORKERS
    if workers == 0 and t.service:
        raise ConfigError(f"reward.num_workers=0 with reward.name={cfg.name}: it waits on a "
                          "service for every call, which inline would stall all generation; "
                          f"set reward.num_workers={DEFAULT_WORKERS}")
    return workers


def names() -> list[str]:
    """Every registered reward name (each also works with the `boxed_` prefix)."""
    return sorted({*_REGISTRY, *_FACTORIES})


registered_names = names


def get_reward_fn(name: str, cfg: Any = None) -> RewardFn:
    """The reward called `name` (see the module doc); `cfg` is the RewardConfig of factories.

    >>> reward = get_reward_fn("exact_match")
    >>> reward(RewardInput(prompt="3+4=", response="7", label="7", finish_reason="stop"))
    1.0
    >>> boxed = get_reward_fn("boxed_exact_match")
    >>> boxed(RewardInput(prompt="", response=r"so \\boxed{7}", label="7"))
    1.0
    """
    if user_code.is_user_code(name):
        return _import_reward(name)
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _FACTORIES:
        if cfg is None:
            from relax_slurm.config.reward import RewardConfig

            cfg = RewardConfig(name=name)
        return _FACTORIES[name](cfg)
    if name.startswith(BOXED_PREFIX) and len(name) > len(BOXED_PREFIX):
        return functools.partial(grade_boxed, get_reward_fn(name[len(BOXED_PREFIX):], cfg))
    raise ConfigError(
        f"reward.name={name!r} is not a registered reward. Fix: use one of {names()} (or "
        f"{BOXED_PREFIX}<name>), or your own: reward.name=package.module:function or "
        "reward.name=path/to/file.py:function"
    )


def grade_boxed(fn: RewardFn, inp: RewardInput) -> float:
    """`fn` applied to the content of the response's last complete `\\boxed{}`; 0 without one."""
    boxed = last_boxed(inp.response)
    if boxed is None:
        return 0.0
    return fn(replace(inp, response=boxed))


class Scorer:
    """The reward of a run, picklable (for worker processes): `Scorer(name, cfg)(inp) -> float`.

    Uses the sample's `metadata["rm_type"]` when set, else `name`; rewards are built once per
    name and process. Raises RewardError when a reward returns something that is not a finite
    number, so that a bad reward is counted as an error instead of poisoning advantages.
    """

    def __init__(self, name: str, cfg: Any = None) -> None:
        self.name = name
        self.cfg = cfg
        self._fns: dict[str, RewardFn] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "cfg": self.cfg}  # built rewards (HTTP clients) stay here

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"], state["cfg"])

    def reward_fn(self, name: str) -> RewardFn:
        if name not in self._fns:
            self._fns[name] = get_reward_fn(name, self.cfg)
        return self._fns[name]

    def __call__(self, inp: RewardInput) -> float:
        name = (inp.metadata or {}).get("rm_type") or self.name
        value = self.reward_fn(str(name))(inp)
        try:
            value = float(value)
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward {name!r} returned {value!r}, not a number") from e
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value}")
        return value


def build_reward(cfg: Any) -> Scorer:
    """The run's reward from its RewardConfig; builds it once so a bad config fails at start."""
    scorer = Scorer(cfg.name, cfg)
    scorer.reward_fn(cfg.name)
    return scorer


def score(
    name: str, response: str, label: Any, metadata: dict[str, Any] | None = None, *,
    prompt: str = "", finish_reason: str = "stop", cfg: Any = None,
) -> float:
    """Score one response with the reward `name` (or `metadata["rm_type"]`).

    >>> score("math", r"so \\boxed{\\frac{1}{2}}", "0.5")
    1.0
    >>> score("exact_match", "7", "7", {"rm_type": "math"})
    1.0
    """
    inp = RewardInput(prompt=prompt, response=response, label=label, metadata=metadata or {},
                      finish_reason=finish_reason)
    return Scorer(name, cfg)(inp)


def _import_reward(path: str) -> RewardFn:
    fn = user_code.load(path, "reward.name")
    if not callable(fn):
        raise ConfigError(f"reward.name={path!r} is a {type(fn).__name__}, not a function. Fix: "
                          "name fn(inp: RewardInput) -> float")
    return fn
