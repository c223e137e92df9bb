"""`genrm`: an LLM judge grades the response (generative reward model).

The judge prompt is `reward.genrm_template` with `{prompt}`, `{response}` (the text after
`</think>` when there is one) and `{label}` replaced; it is sent as raw text (apply the judge's
chat format in the template) to `reward.genrm_url` + `/generate`, the engine's native route
(our hf engine or an SGLang server: `{"text", "sampling_params"}` -> `{"text"}`); with
`reward.genrm_model_path` relax-train serves the judge itself and fills in its URL. The judge's
answer is turned into a number by `reward.genrm_parser`:
- `yes_no`: 1.0 when its last YES/NO (any case) is YES, 0.0 when NO;
- `score`: the number after its last "score:" (else its last number) divided by
  `reward.genrm_max_score`, clamped to [0, 1];
- `exact_one`: 1.0 when its whole answer, stripped, is "1", else 0.0 (Relax's `dapo-genrm`).
An answer the parser cannot read raises RewardError (counted in rollout/reward_errors).
`GenRM(judge, ...)` takes any callable `judge(prompt_text) -> str`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from relax_slurm.errors import ConfigError
from relax_slurm.rewards.extract import final_text
from relax_slurm.rewards.registry import RewardError, RewardInput, register_factory
from relax_slurm.engines.sglang_api import auth_headers

DEFAULT_TEMPLATE = (
    "You are grading a response to a question against a reference answer.\n\n"
    "Question:\n{prompt}\n\nReference answer:\n{label}\n\nResponse:\n{response}\n\n"
    "Is the response's final answer equivalent to the reference answer? "
    "Reply with a short reason, then YES or NO on the last line.\n"
)
CONNECT_RETRY_S = 0.5
JUDGE_GONE = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
NO_JUDGE = ("set reward.genrm_url=http://host:port (a judge you run) or "
            "reward.genrm_model_path=DIR (a judge relax-train serves)")


def parse_yes_no(text: str, max_score: float = 1.0) -> float:
    """1.0 if the judge's last YES/NO is YES, 0.0 if NO.

    >>> parse_yes_no("The numbers differ, so: NO"), parse_yes_no("No doubt it matches. Yes.")
    (0.0, 1.0)
    """
    found = re.findall(r"\b(yes|no)\b", text, re.IGNORECASE)
    if not found:
        raise RewardError(f"genrm: judge answer has no YES/NO: {text[-200:]!r}")
    return 1.0 if found[-1].lower() == "yes" else 0.0


def parse_score(text: str, max_score: float = 10.0) -> float:
    """The judge's score (after the last "score:", else its last number) / max_score, in [0, 1].

    >>> parse_score("Score: 7 out of 10", 10.0), parse_score("I'd give it 12", 10.0)
    (0.7, 1.0)
    """
    found = re.findall(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", text, re.IGNORECASE)
    found = found or re.findall(r"-?\d+(?:\.\d+)?", text)
    if not found:
        raise RewardError(f"genrm: judge answer has no score: {text[-200:]!r}")
    return min(max(float(found[-1]) / max_score, 0.0), 1.0)


def parse_exact_one(text: str, max_score: float = 1.0) -> float:
    """1.0 when the judge's whole answer is "1" (spaces around allowed), else 0.0; never raises.

    >>> parse_exact_one(" 1\\n"), parse_exact_one("1."), parse_exact_one("10"), parse_exact_one("0")
    (1.0, 0.0, 0.0, 0.0)
    """
    return 1.0 if text.strip() == "1" else 0.0


PARSERS: dict[str, Callable[[str, float], float]] = {"yes_no": parse_yes_no,
                                                       "score": parse_score,
                                                       "exact_one": parse_exact_one}


def fill(template: str, prompt: str, response: str, label: str) -> str:
    """`template` with `{prompt}`, `{response}`, `{label}` replaced (other braces kept)."""
    values = {"prompt": prompt, "response": response, "label": label}
    return re.sub(r"\{(prompt|response|label)\}", lambda m: values[m.group(1)], template)


def render(template: str, inp: RewardInput) -> str:
    """The judge prompt of `genrm`: the response is the text after `</think>` when there is one."""
    return fill(template, inp.prompt, final_text(inp.response), str(inp.label))


class EngineJudge:
    """`judge(prompt_text) -> str` through an engine's `/generate` with text input (picklable).

    `managed`: the judge relax-train serves (reward.genrm_model_path), which requires the run's
    engine key (RELAX_ENGINE_API_KEY) as every engine of the run does. A judge you run never
    gets that key: it may be the run's own secret."""

    def __init__(self, url: str, max_new_tokens: int = 512, temperature: float = 0.0,
                 timeout_s: float = 120.0, managed: bool = False) -> None:
        self.url = url.rstrip("/")
        self.managed = managed
        self.sampling_params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
        self.timeout_s = timeout_s

    def __call__(self, prompt_text: str) -> str:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                resp = httpx.post(f"{self.url}/generate",
                                  headers=auth_headers() if self.managed else {},
                                  timeout=max(deadline - time.monotonic(), 1.0),
                                  json={"text": prompt_text,
                                        "sampling_params": self.sampling_params})
                break
            except JUDGE_GONE as e:
                # nothing listens, or the judge dropped the call as it died: a judge restarting
                # in place (relax-train restarts the one it serves) is waited for within the
                # call's timeout instead of scoring 0 (a judge call is safe to repeat)
                if time.monotonic() + CONNECT_RETRY_S >= deadline:
                    raise RewardError(f"genrm judge {self.url}/generate: {e}") from e
                time.sleep(CONNECT_RETRY_S)
            except httpx.HTTPError as e:
                raise RewardError(f"genrm judge {self.url}/generate: "
                                  f"{type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise RewardError(f"genrm judge {self.url}/generate: HTTP {resp.status_code}: "
                              f"{resp.text[:200]}")
        body = resp.json()
        item = body[0] if isinstance(body, list) else body
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise RewardError(f"genrm judge {self.url}/generate: no text in {str(body)[:200]}")
        return item["text"]


class GenRM:
    """LLM-as-judge reward: render the template, ask `judge`, parse its answer."""

    def __init__(self, judge: Callable[[str], str], template: str = DEFAULT_TEMPLATE,
                 parser: str = "yes_no", max_score: float = 1.0) -> None:
        if parser not in PARSERS:
            raise ConfigError(f"reward.genrm_parser={parser!r}: use one of {sorted(PARSERS)}")
        self.judge, self.template, self.parser, self.max_score = judge, template, parser, max_score

    def __call__(self, inp: RewardInput) -> float:
        return PARSERS[self.parser](self.judge(render(self.template, inp)), self.max_score)


@register_factory("genrm", service=True)
def make_genrm(cfg: Any) -> GenRM:
    if not cfg.genrm_url:
        raise ConfigError(f"reward=genrm needs a judge engine: {NO_JUDGE}")
    judge = EngineJudge(cfg.genrm_url, max_new_tokens=cfg.genrm_max_new_tokens,
                        temperature=cfg.genrm_temperature, timeout_s=cfg.genrm_timeout_s,
                        managed=bool(cfg.genrm_model_path))
    return GenRM(judge, template=cfg.genrm_template or DEFAULT_TEMPLATE,
                 parser=cfg.genrm_parser, max_score=cfg.genrm_max_score)
