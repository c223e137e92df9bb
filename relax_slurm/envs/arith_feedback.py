"""`arith_feedback`: answer a sum, get "+" (higher) or "-" (lower) back, try again.

The tiny multi-turn task of `experiment=tiny_agent_cpu`: the prompt is "a+b=" and the label the
answer (the arith data of tools/prepare_data.py). Each model turn is read as a number; a right
answer ends the episode with reward `discount ** (turn - 1)` (1 on the first try), a wrong one
gets the observation "+" when the answer is higher, "-" when it is lower and "*" when the turn
is not a number, with reward 0. The episode also ends after `max_tries` answers (reward 0).
Every observation is made of characters the tiny model's tokenizer has.
"""

from __future__ import annotations

from typing import Any

from relax_slurm.envs.base import BaseEnv, StepResult
from relax_slurm.envs.registration import register_env


@register_env("arith_feedback")
class ArithFeedbackEnv(BaseEnv):
    observation_role = "user"
    blocking = False  # integer parsing: called on the worker's loop

    def __init__(self, discount: float = 0.5, max_tries: int = 3) -> None:
        if not 0 <= discount <= 1 or max_tries < 1:
            raise ValueError(f"discount={discount} must be in [0, 1] and max_tries={max_tries} "
                             ">= 1")
        self.discount, self.max_tries = discount, max_tries
        self.answer: int | None = None
        self.tries = 0

    def reset(self, sample: Any) -> tuple[None, dict]:
        self.answer = int(str(sample.label).strip())
        self.tries = 0
        return None, {}

    def step(self, model_text: str) -> StepResult:
        self.tries += 1
        text = model_text.strip()
        try:
            guess = int(text)
        except ValueError:
            guess = None
        if guess == self.answer:
            return StepResult(None, self.discount ** (self.tries - 1), True, {"tries": self.tries})
        done = self.tries >= self.max_tries
        hint = "*" if guess is None else ("+" if self.answer > guess else "-")
        return StepResult(None if done else hint, 0.0, done, {"tries": self.tries})
