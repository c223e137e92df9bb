"""`env`: multi-turn environments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from relax_slurm.config.check import check

@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn (agentic) rollouts: an environment answers each model turn (docs/agentic.md).
    Without `env.name` every sample is one model turn scored by the reward function."""

    name: Optional[str] = None
    """A registered environment (tool, arith_feedback, ...), `package.module:attr` or
    `path/to/file.py:attr`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment, one instance per episode."""
    max_turns: int = 4
    """Model turns per episode; an episode cut here is marked truncated."""
    max_total_tokens: int = 512
    """Prompt + every turn and observation of an episode (rollout.max_new_tokens bounds each
    model turn); an episode that would pass it ends, marked truncated."""
    reward_source: str = "env"
    """env: the environment's reward of the last step; reward_fn: the reward function (reward.*)
    on the last model turn, the final answer (e.g. env=tool with reward=math)."""
    turn_reward_coef: float = 0.0
    """The episode's reward is that final reward plus this x the earlier turns' rewards from the
    environment (per-turn shaping; 0: the final reward only)."""
    threads: int = 64
    """Threads of the rollout worker that run the environments' plain (not async) reset, step
    and close, so a call that blocks (a subprocess, an HTTP request) holds up its own episode
    and not the worker's loop, which drives every other episode and heartbeats (a blocked loop
    looks hung). At most this many such calls at once; async methods, and those of
    environments that declare `blocking = False` (the built-ins), run on the loop."""

    def __post_init__(self) -> None:
        check(self.reward_source in ("env", "reward_fn"),
               f"env.reward_source={self.reward_source!r}: use env or reward_fn")
        check(self.max_turns >= 1, f"env.max_turns={self.max_turns}: must be >= 1")
        check(self.threads >= 1, f"env.threads={self.threads}: must be >= 1")
        check(self.max_total_tokens >= 2,
               f"env.max_total_tokens={self.max_total_tokens}: must be >= 2")
