"""`remote`: a reward computed by your HTTP server.

POST `reward.remote_url` with JSON `{"prompt", "response", "label", "metadata"}`; the answer is
a JSON number or an object with a numeric `reward` (or `score`). Each attempt has a timeout
(`reward.remote_timeout_s`); connection errors, timeouts, HTTP 429 and 5xx are retried up to
`reward.remote_max_retries` times with exponential backoff (`reward.remote_backoff_s`, doubled
each retry); other 4xx fail at once. A failure raises RewardError (the reward pool scores the
sample 0 and counts it in rollout/reward_errors).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from relax_slurm.errors import ConfigError
from relax_slurm.rewards.registry import RewardError, RewardInput, register_factory

_RETRY_STATUS = (429, 500, 502, 503, 504)


def parse_reward(body: Any) -> float:
    """The reward in a server's JSON answer: a number, or {"reward": x} / {"score": x}.

    >>> parse_reward(0.5), parse_reward({"reward": 1}), parse_reward({"score": "0.25"})
    (0.5, 1.0, 0.25)
    """
    if isinstance(body, dict):
        body = body.get("reward", body.get("score"))
    if isinstance(body, bool) or body is None:
        raise RewardError(f"remote reward: answer has no numeric reward: {body!r}")
    try:
        return float(body)
    except (TypeError, ValueError) as e:
        raise RewardError(f"remote reward: answer has no numeric reward: {body!r}") from e


class RemoteReward:
    """Picklable remote reward: `RemoteReward(url, ...)(inp) -> float` (client made lazily)."""

    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 3,
                 backoff_s: float = 0.5) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self._client: httpx.Client | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_client"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _client=None)

    def _post(self, body: dict[str, Any]) -> httpx.Response:
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s)
        return self._client.post(self.url, json=body)

    def __call__(self, inp: RewardInput) -> float:
        body = {"prompt": inp.prompt, "response": inp.response, "label": inp.label,
                "metadata": inp.metadata or {}}
        problem = "no attempt"
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = self._post(body)
            except httpx.HTTPError as e:  # connection refused, timeouts, protocol errors
                problem = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code in _RETRY_STATUS:
                problem = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code >= 400:
                raise RewardError(f"remote reward {self.url}: HTTP {resp.status_code}: "
                                  f"{resp.text[:200]}")
            try:
                return parse_reward(resp.json())
            except ValueError as e:
                raise RewardError(f"remote reward {self.url}: answer is not JSON: "
                                  f"{resp.text[:200]!r}") from e
        raise RewardError(f"remote reward {self.url}: failed {self.max_retries + 1} times, "
                          f"last: {problem}")


@register_factory("remote", service=True)
def make_remote(cfg: Any) -> RemoteReward:
    if not cfg.remote_url:
        raise ConfigError("reward=remote needs the server's address: set "
                          "reward.remote_url=http://host:port/path")
    return RemoteReward(cfg.remote_url, timeout_s=cfg.remote_timeout_s,
                        max_retries=cfg.remote_max_retries, backoff_s=cfg.remote_backoff_s)
