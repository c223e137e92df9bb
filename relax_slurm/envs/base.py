"""The environment interface of multi-turn rollouts.

An environment plays the other side of a conversation: the rollout worker builds one per sample
(one per episode), resets it with the dataset row, then alternates model turns and environment
steps until the environment says `done` or a limit is reached (see rollout/multiturn.py):

    obs, info = await env.reset(prompt)                # optional first observation
    while True:
        text = <the model's turn, decoded>
        obs, reward, done, info = await env.step(text)  # a StepResult (a NamedTuple)
        if done: break
        messages = env.format_observation(obs)          # chat messages appended as tokens
    await env.close()

Every method may be a coroutine or a plain function. The driver awaits a coroutine on the
worker's event loop, which drives many episodes at once and heartbeats; a plain `reset`, `step`
or `close` it runs in a thread (`env.threads` of them), so one that blocks (a subprocess, an
HTTP request, a sleep) holds up its own episode only. A class whose plain methods take
microseconds sets `blocking = False` and they are called on the loop (the built-ins do; a
subclass that overrides one of them is threaded again unless it says so too). An
environment is used by one episode only: keep per-episode state on `self` (instances run in
different threads at once).

Observations are whatever the environment likes; `format_observation` turns one into chat
messages (`{"role": ..., "content": ...}`), which the driver renders with the tokenizer's chat
template and appends to the conversation as tokens the model is not trained on. A message may
carry an `"images"` list (paths or URLs): the multimodal hook. The driver records them in the
sample (`Sample.multimodal["observation_images"]`, with the turn and token offset) so that the
omni-modal path can feed them to engine and trainer; text engines do not see them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from relax_slurm.errors import RelaxError

Message = dict[str, Any]


class EnvError(RelaxError):
    """An environment could not be built or broke its contract (a wrong return type, ...)."""


class StepResult(NamedTuple):
    """What `step` returns; a plain `(observation, reward, done, info)` tuple works too."""

    observation: Any = None
    """The next observation (None: nothing to add, e.g. when done)."""
    reward: float = 0.0
    """This turn's reward. The reward of the step that ends the episode is the final reward
    (env.reward_source=env); earlier ones are per-turn shaping (env.turn_reward_coef)."""
    done: bool = False
    info: Optional[dict] = None
    """Free-form, msgpack-able; kept per turn in the sample's metadata."""


class BaseEnv:
    """Override `step` (and `reset`, `format_observation`, `close` as needed).

    Class attributes the driver reads:
    - `tools`: JSON schemas of callable tools (OpenAI / Qwen function format); when set and
      the data uses the chat template, the prompt is rendered with them (the template's tools
      section tells the model how to call them);
    - `stop`: strings that end a model turn and hand the text to `step` (e.g. "</tool_call>"),
      on top of the model's end-of-turn token.
    """

    tools: Optional[list[dict]] = None
    stop: tuple[str, ...] = ()
    observation_role: str = "user"
    """The role `format_observation` gives a plain-text observation."""
    blocking: bool = True
    """Plain (not async) `reset`, `step` and `close` may block: the driver runs them in a
    thread. False: those this class defines take microseconds, and are called on the worker's
    event loop."""

    def reset(self, sample: Any) -> tuple[Any, dict]:
        """Start an episode for `sample` (a `relax_slurm.data.Prompt`: prompt_id, text,
        label, metadata, messages). Returns (first observation or None, info)."""
        return None, {}

    def step(self, model_text: str) -> StepResult:
        """React to the model's turn (decoded, special tokens skipped)."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def format_observation(self, observation: Any) -> list[Message]:
        """Observation -> chat messages. A string becomes one message of `observation_role`;
        a dict is taken as one message, a list as messages."""
        if observation is None:
            return []
        if isinstance(observation, str):
            return [{"role": self.observation_role, "content": observation}]
        if isinstance(observation, dict):
            return [observation]
        if isinstance(observation, (list, tuple)):
            return list(observation)
        raise EnvError(f"{type(self).__name__}: cannot format an observation of type "
                       f"{type(observation).__name__}; override format_observation")

    def close(self) -> None:
        """Release what the episode held (processes, connections); called once, always."""
