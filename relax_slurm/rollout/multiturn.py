"""Multi-turn episodes: model turns and environment observations, kept as tokens.

Token in, token out: an episode's sequence is the prompt's ids, then every model turn's output
ids exactly as the engine sampled them, then the ids the chat template puts around each
observation; nothing the model wrote is ever re-tokenised (a decode/encode round trip can change
ids, and the trainer must score exactly the tokens the engine sampled). Model tokens get loss
mask 1 and their rollout log-probs; template and observation tokens mask 0 and log-prob 0, so
the trainer's masked losses and importance ratios see the model's tokens only.

    episode = await run_episode(generate, env, prompt, renderer, limits, params)

An episode ends when the environment says `done`, after `limits.max_turns` model turns, or when
the next turn or observation would pass `limits.max_total_tokens` (prompt included); the last
two mark it truncated. A model turn also ends at any of the environment's `stop` strings (the
engine stops there; the text handed to `env.step` is cut at the match, the ids are kept).

A first observation from `env.reset` extends the prompt (`Episode.prompt_ids`): it is rendered
where the chat template puts a message after the prompt's, before the generation prompt.

The pieces (`Episode.add_turn`, `ObservationRenderer.between_turns`, `episode_sample`) are
shared with the OpenAI-compatible proxy (rollout/proxy.py), whose turns come from an external
agent instead of an environment.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

from relax_slurm.envs.base import BaseEnv, EnvError, Message, StepResult
from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.env_threads import EnvThreads
from relax_slurm.rollout.partial import version_record
from relax_slurm.routing.segments import TurnRouting
from relax_slurm.sample_meta import SampleMeta
from relax_slurm.samples import Sample

Generate = Callable[[list[int], dict[str, Any], int], Awaitable[GenerateResult]]
"""(input ids, sampling params, routed_experts_start_len) -> the turn's result."""
END_REASONS = ("done", "max_turns", "max_total_tokens")
_PROBE_USER, _PROBE_MODEL = "relax-probe-user", "relax-probe-model"


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_total_tokens: int
    """Prompt + every turn and observation of the episode."""
    max_new_tokens: int
    """Per model turn (rollout.max_new_tokens)."""

    @classmethod
    def of(cls, cfg: Any) -> TurnLimits:
        """A run's bounds: env.max_turns, env.max_total_tokens, rollout.max_new_tokens."""
        return cls(cfg.env.max_turns, cfg.env.max_total_tokens, cfg.rollout.max_new_tokens)


@dataclass
class Episode:
    prompt_ids: list[int] = field(default_factory=list)
    """What the first model turn continues: the prompt, and a first observation if any."""
    response_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: model turns and observations, in order."""
    loss_mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turns: int = 0
    end: str = "done"
    finish_reason: str = "stop"
    """The last model turn's (stop / length / abort)."""
    images: list[dict] = field(default_factory=list)
    """Images observations carried ({"turn", "offset", "images"}): the multimodal hook."""
    infos: list[dict] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weight version of each model turn (an async run may update weights mid-episode)."""
    version_spans: list[list[int]] = field(default_factory=list)
    """[version, start, end] runs of response_ids the model sampled (Sample.version_spans)."""
    last_turn_text: str = ""
    """The last model turn as handed to the environment (the final answer)."""
    routing: TurnRouting = field(default_factory=TurnRouting)
    """MoE models: each turn's routed experts (relax_slurm.routing.segments)."""

    def add_images(self, messages: list[Message]) -> None:
        """Record the images the messages about to be appended carry (the multimodal hook)."""
        images = [img for m in messages for img in m.get("images", ())]
        if images:
            self.images.append({"turn": self.turns, "offset": len(self.response_ids),
                                "images": images})

    @property
    def truncated(self) -> bool:
        return self.end != "done"

    def reward(self, turn_reward_coef: float = 0.0) -> float:
        """The last step's reward, plus `turn_reward_coef` x the earlier turns' (shaping)."""
        if not self.turn_rewards:
            return 0.0
        return self.turn_rewards[-1] + turn_reward_coef * sum(self.turn_rewards[:-1])

    def add(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.loss_mask += [1.0 if model else 0.0] * len(ids)
        self.logprobs += list(logprobs) if model else [0.0] * len(ids)

    def add_turn(self, res: GenerateResult, input_ids: list[int] | None = None) -> None:
        """A model turn as the engine sampled it from `input_ids` (default: the episode so
        far): its ids (mask 1), log-probs, version and routed experts."""
        input_ids = self.prompt_ids + self.response_ids if input_ids is None else input_ids
        generated = int(res.meta_info.get("completion_tokens", len(res.output_ids)))
        self.routing.add(input_ids, res.output_ids, generated, res.routed_start,
                         res.routed_experts)
        self.version_spans += version_record(res, offset=len(self.response_ids))
        self.add(res.output_ids, model=True, logprobs=res.logprobs)
        self.turns += 1
        self.finish_reason = res.finish_reason
        self.versions.extend(res.versions() or [0])

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def room(self, max_total_tokens: int) -> int:
        """Tokens left in the episode's budget."""
        return max_total_tokens - self.total_tokens


class ObservationRenderer:
    """The ids the chat template puts after a model turn: the rest of the turn's closing (what
    the model did not sample itself, e.g. the newline after `<|im_end|>`) and the observation's
    messages with the next generation prompt.

    Found by rendering a probe conversation with and without the messages and keeping the text
    that was added, so any template works whose earlier turns render the same whatever follows
    them (an `EnvError` says so otherwise). Without the chat template (data.apply_chat_template
    = false) an observation is its messages' contents, one per line."""

    def __init__(self, tokenizer: Any, apply_chat_template: bool) -> None:
        self.tokenizer, self.chat = tokenizer, apply_chat_template
        self._close_ids: list[int] = []
        if self.chat:
            closed = self._render(self._probe(), False)
            at = closed.rfind(_PROBE_MODEL)
            if at < 0:
                raise EnvError("the tokenizer's chat template does not render an assistant "
                               "turn as its content: multi-turn rollouts cannot place "
                               "observations; set data.apply_chat_template=false")
            self._close_ids = self._encode(closed[at + len(_PROBE_MODEL):])

    def _probe(self) -> list[Message]:
        return [{"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": _PROBE_MODEL}]

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def close_ids(self, model_ids: list[int]) -> list[int]:
        """What closes a model turn that ended with `model_ids`, minus the part it sampled
        (an EOS that is the template's end-of-turn token)."""
        for k in range(min(len(self._close_ids), len(model_ids)), 0, -1):
            if model_ids[-k:] == self._close_ids[:k]:
                return self._close_ids[k:]
        return self._close_ids

    def observation_ids(self, messages: list[Message]) -> list[int]:
        if not messages:
            return []
        if not self.chat:
            return self._encode("".join(f"\n{m.get('content', '')}" for m in messages) + "\n")
        before = self._render(self._probe(), False)
        after = self._render([*self._probe(), *messages], True)
        if not after.startswith(before):
            raise EnvError("the tokenizer's chat template renders earlier turns differently "
                           "once an observation follows; multi-turn rollouts need a template "
                           "that only appends (or data.apply_chat_template=false)")
        return self._encode(after[len(before):])

    def between_turns(self, model_ids: list[int], messages: list[Message]) -> list[int]:
        """Everything after a model turn that ended with `model_ids` up to the next one's
        generation prompt: the turn's closing and the messages (all loss mask 0)."""
        return self.close_ids(model_ids) + self.observation_ids(messages)

    def first_observation_ids(self, prompt_ids: list[int], messages: list[Message]
                              ) -> list[int]:
        """The prompt extended by messages that come before the model's first turn (a first
        observation from `env.reset`): the prompt's generation prompt moves after them."""
        if not messages:
            return list(prompt_ids)
        if not self.chat:
            return list(prompt_ids) + self.observation_ids(messages)
        user = [{"role": "user", "content": _PROBE_USER}]
        bare, prompted = self._render(user, False), self._render(user, True)
        after = self._render([*user, *messages], True)
        if not (prompted.startswith(bare) and after.startswith(bare)):
            raise EnvError("the tokenizer's chat template renders the prompt differently once "
                           "a first observation follows; return None from reset and put the "
                           "observation in the dataset's prompt")
        gen = self._encode(prompted[len(bare):])  # the generation prompt the prompt ends with
        if gen and list(prompt_ids[-len(gen):]) != gen:
            raise EnvError("the prompt does not end with the chat template's generation prompt, "
                           "so a first observation cannot be placed before it; return None from "
                           "reset and put the observation in the dataset's prompt")
        return list(prompt_ids[:len(prompt_ids) - len(gen)]) + self._encode(after[len(bare):])


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` (0-based) of the sample seeded `seed`; turn 0 keeps it."""
    return (seed + turn * 0x9E3779B97F4A7C15) % 2**63


async def _call(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _env_call(env: BaseEnv, method: str, threads: EnvThreads | None, *args: Any) -> Any:
    """`env.<method>(*args)`: a coroutine awaited on the loop; a plain method that may block in
    `threads` (env.threads), so that a call that blocks (a subprocess, a request) does not stop
    the loop that drives every other episode and heartbeats."""
    fn = getattr(env, method)
    if threads is None or inspect.iscoroutinefunction(fn) or not _may_block(type(env), method):
        return await _call(fn(*args))
    return await _call(await threads.run(fn, *args))


def _may_block(cls: type, method: str) -> bool:
    """Whether `method` may block: unless the class that defines it declares `blocking = False`
    itself (a subclass of a built-in that overrides `step` is threaded again); BaseEnv's own
    no-op `reset` and `close` do not."""
    for klass in cls.__mro__:
        if method in vars(klass):
            return klass is not BaseEnv and vars(klass).get("blocking", True)
    return True


def _as_step(result: Any) -> StepResult:
    try:
        return StepResult(*result)
    except TypeError as e:
        raise EnvError(f"env.step must return (observation, reward, done, info), got "
                       f"{result!r}") from e


async def run_episode(generate: Generate, env: BaseEnv, prompt: Any, prompt_ids: list[int],
                      renderer: ObservationRenderer, limits: TurnLimits,
                      params: dict[str, Any], decode: Callable[[list[int]], str],
                      threads: EnvThreads | None = None) -> Episode:
    """One episode of `env` from `prompt`; the environment is closed whatever happens. `threads`:
    the threads that run a blocking environment's plain methods (None: on the loop)."""
    ep = Episode(prompt_ids=list(prompt_ids))
    try:
        first, _ = await _env_call(env, "reset", threads, prompt)
        if first is not None:
            ep.prompt_ids = renderer.first_observation_ids(
                ep.prompt_ids, env.format_observation(first))
        stop = list(params.get("stop") or []) + list(getattr(env, "stop", ()) or ())
        while True:
            room = ep.room(limits.max_total_tokens)
            if room <= 0:
                ep.end = "max_total_tokens"
                break
            turn_params = {**params, "max_new_tokens": min(limits.max_new_tokens, room)}
            if "sampling_seed" in params:  # a seed per (sample, turn): turns draw afresh, and a
                # resumed run redraws exactly the same tokens
                turn_params["sampling_seed"] = turn_seed(params["sampling_seed"], ep.turns)
            if stop:
                turn_params["stop"] = stop
            ids = ep.prompt_ids + ep.response_ids
            # only the positions no earlier turn covered: each keeps the routing of the
            # forward that processed it (relax_slurm.routing.segments)
            res = await generate(ids, turn_params, ep.routing.start_for(ids))
            ep.add_turn(res, ids)
            text = ep.last_turn_text = res.text if stop else decode(res.output_ids)
            step = _as_step(await _env_call(env, "step", threads, text))
            ep.turn_rewards.append(float(step.reward))
            ep.infos.append(dict(step.info or {}))
            if step.done:
                ep.end = "done"
                break
            if ep.turns >= limits.max_turns:
                ep.end = "max_turns"
                break
            messages = env.format_observation(step.observation)
            obs_ids = renderer.between_turns(res.output_ids, messages)
            if ep.total_tokens + len(obs_ids) >= limits.max_total_tokens:
                ep.end = "max_total_tokens"  # no room left for the model's answer to it
                break
            ep.add_images(messages)
            ep.add(obs_ids, model=False)
    finally:
        await _env_call(env, "close", threads)
    return ep


def episode_sample(ep: Episode, *, prompt_id: str, group_id: int, reward: float,
                   metadata: SampleMeta, teacher_logprobs: Any = None,
                   routed_experts: Any = None) -> Sample:
    """The trainable sample of an episode: model tokens mask 1 with their rollout log-probs,
    the rest mask 0; stamped with the oldest and newest weight version of its turns.
    `teacher_logprobs`: [R], on-policy distillation (0 at environment tokens);
    `routed_experts`: its turns' routing (relax_slurm.routing.segments.sample_rows)."""
    return Sample(
        prompt_id=prompt_id, group_id=group_id, prompt_ids=ep.prompt_ids,
        response_ids=ep.response_ids, loss_mask=ep.loss_mask, rollout_logprobs=ep.logprobs,
        teacher_logprobs=teacher_logprobs, routed_experts=routed_experts,
        reward=float(reward), version=max(ep.versions),
        version_min=min(ep.versions),
        version_spans=ep.version_spans,
        # a truncated episode counts as cut by length in rollout/truncated_frac
        finish_reason="length" if ep.truncated else ep.finish_reason,
        multimodal={"observation_images": ep.images} if ep.images else {},
        metadata=replace(metadata, turns=ep.turns, episode_end=ep.end).to_dict(),
    )
