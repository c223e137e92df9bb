"""Multi-turn episodes against a real hf engine (the tiny model of tools/make_tiny_model.py):
loss masks over 3+ turns, token in == token out, and each way an episode ends."""

from __future__ import annotations

import asyncio

import pytest

from helpers_tiny import running_engine
from relax_slurm.data import load_tokenizer
from relax_slurm.envs import BaseEnv, StepResult
from relax_slurm.engines.async_client import AsyncEngineClient
from relax_slurm.rollout.multiturn import ObservationRenderer, TurnLimits, run_episode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PARAMS = {"temperature": 1.0, "sampling_seed": 7}


class Hints(BaseEnv):
    """Answers every turn with "+", rewards turn k with k, done after `turns` turns."""

    def __init__(self, turns: int) -> None:
        self.turns, self.seen, self.closed = turns, [], False

    def step(self, model_text: str) -> StepResult:
        self.seen.append(model_text)
        done = len(self.seen) >= self.turns
        return StepResult(None if done else "+", float(len(self.seen)), done, {"n": len(self.seen)})

    async def close(self) -> None:  # a coroutine: the driver awaits it
        self.closed = True


@pytest.fixture(scope="module")
def engine(tiny_assets, tmp_path_factory):
    with running_engine(tiny_assets / "model", tmp_path_factory.mktemp("mt"),
                        timeout_s=200) as url:
        yield url


def episode(engine_url, tiny_assets, env, limits, prompt_ids=(3, 4, 5)):
    tok = load_tokenizer(tiny_assets / "model")
    renderer = ObservationRenderer(tok, apply_chat_template=True)
    seen = []  # (input ids, params, output ids) of every /generate

    async def go():
        client = AsyncEngineClient(engine_url, timeout_s=60)
        try:
            async def generate(ids, params, routed_start):
                [res] = await client.generate([ids], [params], routed_start=routed_start)
                seen.append((list(ids), params, list(res.output_ids)))
                return res
            return await run_episode(generate, env, None, list(prompt_ids), renderer, limits,
                                     PARAMS, lambda ids: tok.decode(ids, skip_special_tokens=True))
        finally:
            await client.aclose()

    return asyncio.run(go()), seen, renderer


def test_masks_cover_exactly_the_model_tokens_over_three_turns(engine, tiny_assets):
    env = Hints(turns=3)
    ep, seen, renderer = episode(engine, tiny_assets, env, TurnLimits(5, 200, 4))
    assert (ep.turns, ep.end, ep.truncated) == (3, "done", False) and env.closed
    assert ep.turn_rewards == [1.0, 2.0, 3.0] and ep.reward() == 3.0 and ep.reward(0.5) == 4.5
    assert [i["n"] for i in ep.infos] == [1, 2, 3]
    prompt, hint = [3, 4, 5], [{"role": "user", "content": "+"}]
    obs = renderer.observation_ids(hint)
    assert obs  # the template renders the hint as tokens
    # token in == token out: turn k was sampled from the prompt + every id before it, and the
    # episode's ids are the engine's outputs exactly, with the observations (mask 0) between
    ids, mask = [], []
    for k, (sent, params, out) in enumerate(seen):
        assert sent == prompt + ids and params["max_new_tokens"] == 4 and out
        ids, mask = ids + out, mask + [1.0] * len(out)
        if k < len(seen) - 1:
            between = renderer.close_ids(out) + obs
            ids, mask = ids + between, mask + [0.0] * len(between)
    assert ep.response_ids == ids and ep.loss_mask == mask
    assert len(ep.logprobs) == len(ids)
    # each model turn is one version run (no sync came), placed where its tokens are: the
    # observations between turns lie in none
    assert [v for v, _, _ in ep.version_spans] == [0] * len(seen)
    assert [i for _, a, b in ep.version_spans for i in range(a, b)] == \
        [i for i, m in enumerate(mask) if m]
    assert all(lp <= 0 for lp, m in zip(ep.logprobs, mask) if m) and \
        all(lp == 0 for lp, m in zip(ep.logprobs, mask) if not m)


def test_max_turns_and_token_budget_truncate(engine, tiny_assets):
    ep, seen, _ = episode(engine, tiny_assets, Hints(turns=10), TurnLimits(2, 200, 4))
    assert (ep.turns, ep.end, ep.truncated, len(seen)) == (2, "max_turns", True, 2)
    ep, seen, _ = episode(engine, tiny_assets, Hints(turns=10), TurnLimits(10, 12, 4))
    assert ep.end == "max_total_tokens" and ep.truncated
    assert 3 + len(ep.response_ids) <= 12  # never past the budget
    assert all(p["max_new_tokens"] <= 12 - len(ids) for ids, p, _ in seen)
