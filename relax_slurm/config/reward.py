"""`reward`: the reward function, its worker pool, remote and judge (genrm) rewards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from relax_slurm.config.check import check


@dataclass(kw_only=True)
class RewardConfig:
    name: str = "exact_match"
    """A registered reward (see relax_slurm.rewards), boxed_<name>, or a dotted path
    module:function; a sample's metadata.rm_type overrides it."""
    num_workers: Optional[int] = None
    """Reward worker processes per rollout worker (the concurrency cap); 0 scores in the rollout
    worker's own process: no timeout and no isolation, no per-response IPC either (for pure,
    fast rule rewards). null: 0 for the rewards registered inline (exact_match,
    prefix_match), else 4. Refused as 0 for rewards registered as calling a service (remote,
    genrm, dapo-genrm, dapo_rule_genrm). Resolved by relax_slurm.rewards.reward_workers, where
    the rewards are registered (the config does not import them)."""
    timeout_s: float = 60.0
    """Per-response time limit; a reward that takes longer scores 0 and counts as an error."""
    remote_url: Optional[str] = None
    """remote: the URL rewards are POSTed to."""
    remote_timeout_s: float = 30.0
    """remote: timeout of one attempt."""
    remote_max_retries: int = 3
    """remote: retries after a connection error, timeout, HTTP 429 or 5xx."""
    remote_backoff_s: float = 0.5
    """remote: wait before the first retry, doubled for each further one."""
    genrm_url: Optional[str] = None
    """genrm, dapo-genrm: base URL of a judge engine you run (hf engine or SGLang server;
    /generate). Exclusive with genrm_model_path."""
    genrm_model_path: Optional[str] = None
    """genrm, dapo-genrm: Hugging Face directory of a judge model relax-train serves itself on
    one more engine (role `genrm`, health-checked and restarted like the others, outside the
    weight sync). Exclusive with genrm_url."""
    genrm_template: Optional[str] = None
    """genrm, dapo-genrm: judge prompt with {prompt}, {response}, {label}; null: the built-in."""
    genrm_parser: str = "yes_no"
    """genrm: how to read the judge's answer: yes_no, score or exact_one."""
    genrm_max_score: float = 10.0
    """genrm, score parser: the judge's score is divided by this."""
    genrm_max_new_tokens: int = 512
    """genrm: tokens the judge may generate."""
    genrm_temperature: float = 0.0
    """genrm: judge sampling temperature (0: greedy)."""
    genrm_timeout_s: float = 50.0
    """genrm: timeout of one judge call."""

    def __post_init__(self) -> None:
        check(self.num_workers is None or self.num_workers >= 0,
              f"reward.num_workers={self.num_workers}: must be >= 0 (0: score in the rollout "
              "worker's process), or null")
        check(self.timeout_s > 0, f"reward.timeout_s={self.timeout_s}: must be > 0")
        check(self.remote_max_retries >= 0,
               f"reward.remote_max_retries={self.remote_max_retries}: must be >= 0")
        check(self.remote_timeout_s > 0 and self.remote_backoff_s >= 0,
               "reward.remote_timeout_s must be > 0 and reward.remote_backoff_s >= 0")
        check(self.genrm_parser in ("yes_no", "score", "exact_one"),
               f"reward.genrm_parser={self.genrm_parser!r}: use yes_no, score or exact_one")
        check(self.genrm_max_score > 0,
               f"reward.genrm_max_score={self.genrm_max_score}: must be > 0")
        if self.name == "remote":
            check(self.timeout_s >= self.remote_timeout_s,
                   f"reward.timeout_s={self.timeout_s} is below reward.remote_timeout_s="
                   f"{self.remote_timeout_s}: raise reward.timeout_s so one attempt fits")
        if self.name in ("genrm", "dapo-genrm", "dapo_rule_genrm"):
            check(self.timeout_s >= self.genrm_timeout_s,
                   f"reward.timeout_s={self.timeout_s} is below reward.genrm_timeout_s="
                   f"{self.genrm_timeout_s}: raise reward.timeout_s so one judge call fits")
