r"""`dapo-genrm`: DAPO math answers graded by an LLM judge, as Relax's reward of that name.

Relax's `dapo-genrm` asks the judge about every response; no rule grades first:
- the model's answer sent to the judge is everything after the response's last `Answer:`
  (case-sensitive), or its last 300 characters when it has none;
- the question is `metadata.question` (else the prompt), the reference `metadata.label` (else
  the label; a list is joined with " or ");
- they fill Relax's judge prompt (`DAPO_TEMPLATE`, or `reward.genrm_template` with `{prompt}`,
  `{response}`, `{label}`), sent to `reward.genrm_url` + `/generate` as for `genrm`;
- the reward is 1.0 when the judge's whole answer, stripped, is "1", else 0.0 ("1.", "Yes" or
  "10" score 0, as in Relax). A judge that fails raises (a reward error).

`dapo_rule_genrm` is the rule-first variant: the `dapo` rule (the last `Answer:` line, graded
as `math` grades, math-verify included) pays 1.0 without a judge call when it finds the answer
equal to the label; only what the rule cannot confirm (no `Answer:` line, or an answer the rule
finds different, which may be an equivalent form it does not know) goes to the judge as above.
It saves the judge calls of every right answer the rule recognises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax_slurm.errors import ConfigError
from relax_slurm.rewards.dapo import extract_dapo_answer
from relax_slurm.rewards.extract import label_list
from relax_slurm.rewards.genrm import NO_JUDGE, EngineJudge, fill, parse_exact_one
from relax_slurm.rewards.math import matches_any
from relax_slurm.rewards.registry import RewardInput, register_factory

# Relax's judge prompt for dapo-genrm (relax/engine/rewards/dapo_genrm.py, Apache-2.0), kept word
# for word so that a judge answers as it does under Relax; {prompt}, {label}, {response} stand
# for its {question}, {ground_truth}, {predict_str}.
DAPO_TEMPLATE = (
    "Below are two answers to a question. Question is [Question], [Standard Answer] is the "
    "standard answer to the question, and [Model_answer] is the answer extracted from a model's "
    "output to this question.  Determine whether these two answers are consistent.\n"
    "Note that [Model Answer] is consistent with [Standard Answer] whenever they are essentially "
    "the same. If the meaning is expressed in the same way, it is considered consistent, for "
    "example, 'pink' and 'it is pink'.\n"
    "If they are consistent, Judgement is 1; if they are different, Judgement is 0. Just output "
    "Judgement and don't output anything else.\n\n"
    "[Question]: {prompt}\n"
    "[Standard Answer]: {label}\n"
    "[Model_answer] : {response}\n"
    "Judgement:"
)
TAIL_CHARS = 300


def judged_answer(response: str) -> str:
    """What the judge sees of the response: after the last `Answer:`, else the last 300 chars.

    >>> judged_answer("think...\\nAnswer: 42\\n")
    ' 42\\n'
    >>> judged_answer("x" * 400 + "the end") == ("x" * 400 + "the end")[-300:]
    True
    """
    if "Answer:" in response:
        return response.split("Answer:")[-1]
    return response[-TAIL_CHARS:]


def judge_prompt(template: str, inp: RewardInput) -> str:
    """The filled judge prompt: question and reference from the metadata when it has them."""
    metadata = inp.metadata or {}
    question = metadata.get("question", inp.prompt)
    reference = metadata.get("label", inp.label)
    if isinstance(reference, (list, tuple)):
        reference = " or ".join(str(r) for r in reference)
    return fill(template, str(question), judged_answer(inp.response), str(reference))


class DapoGenRM:
    """The judge on every response (`dapo-genrm`), or after the rule (`rule_first`)."""

    def __init__(self, judge: Callable[[str], str], template: str = DAPO_TEMPLATE,
                 rule_first: bool = False) -> None:
        self.judge, self.template, self.rule_first = judge, template, rule_first

    def __call__(self, inp: RewardInput) -> float:
        if self.rule_first:
            answer = extract_dapo_answer(inp.response)
            if answer is not None and matches_any(answer, label_list(inp.label)):
                return 1.0
        return parse_exact_one(self.judge(judge_prompt(self.template, inp)))


def _make(cfg: Any, name: str, rule_first: bool) -> DapoGenRM:
    if not cfg.genrm_url:
        raise ConfigError(f"reward {name!r} asks a judge engine: {NO_JUDGE}")
    judge = EngineJudge(cfg.genrm_url, max_new_tokens=cfg.genrm_max_new_tokens,
                        temperature=cfg.genrm_temperature, timeout_s=cfg.genrm_timeout_s,
                        managed=bool(cfg.genrm_model_path))
    return DapoGenRM(judge, template=cfg.genrm_template or DAPO_TEMPLATE, rule_first=rule_first)


@register_factory("dapo-genrm", service=True)
def make_dapo_genrm(cfg: Any) -> DapoGenRM:
    return _make(cfg, "dapo-genrm", rule_first=False)


@register_factory("dapo_rule_genrm", service=True)
def make_dapo_rule_genrm(cfg: Any) -> DapoGenRM:
    return _make(cfg, "dapo_rule_genrm", rule_first=True)
