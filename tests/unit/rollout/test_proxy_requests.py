"""The proxy's request parsing and history rule, and a first observation from `env.reset`
(the prompt grows by it, the generation prompt moves after it): pure, on the tiny character
tokenizer with a template whose generation prompt is not empty."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relax_slurm.envs import BaseEnv, StepResult
from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.multiturn import ObservationRenderer, TurnLimits, run_episode
from relax_slurm.rollout.openai_chat import ProxyError, new_messages, parse_chat_request

# user turns start with "=", assistant turns with "*" and end with EOS; the generation prompt
# is "*": a template that only appends, with something to move after a first observation
MARKED_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{- '*' + m['content'] + eos_token -}}"
    "{%- else -%}{{- '=' + m['content'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '*' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tok():
    from relax_slurm.tiny.model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = MARKED_TEMPLATE
    return tokenizer


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_parse_chat_request_accepts_openai_bodies_and_names_what_is_wrong():
    req = parse_chat_request({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "1+"},
                                                               {"type": "text", "text": "2="}]}],
        "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "stop": "=", "seed": 3, "n": 1,
        "logprobs": True, "stream": False})
    assert req.messages == [{"role": "user", "content": "1+2="}]
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.seed, req.logprobs) == \
        (5, 0.7, 0.9, ("=",), 3, True)
    assert parse_chat_request({"messages": [{"role": "user", "content": "x"}],
                               "max_completion_tokens": 2}).max_tokens == 2
    bad = [([], "JSON object"), ({"messages": []}, "non-empty"),
           ({"messages": [{"content": "x"}]}, "role"),
           ({"messages": [{"role": "assistant", "content": None}]}, "content"),
           ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "`n`"),
           ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "`stream`"),
           ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
           ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
           ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature")]
    for body, match in bad:
        with pytest.raises(ProxyError, match=match) as e:
            parse_chat_request(body)
        assert e.value.status == 400 and e.value.body()["error"]["code"] == 400


def test_a_session_only_grows():
    history = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "4"}]
    more = [*history, {"role": "user", "content": "-"}]
    assert new_messages(history, more) == [{"role": "user", "content": "-"}]
    rewritten = [history[0], {"role": "assistant", "content": "3"}, more[2]]
    with pytest.raises(ProxyError, match=r"messages\[1\] \(assistant\) differs") as e:
        new_messages(history, rewritten)
    assert e.value.status == 409
    with pytest.raises(ProxyError, match="do not extend"):
        new_messages(history, history)


class FirstObservation(BaseEnv):
    def reset(self, sample):
        return "5", {}

    def step(self, model_text):
        return StepResult(None, 1.0, True, {})


def test_a_first_observation_from_reset_extends_the_prompt(tok):
    renderer = ObservationRenderer(tok, apply_chat_template=True)
    prompt = tok.apply_chat_template([{"role": "user", "content": "3+4"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt == "=3+4*"
    sent = []

    async def generate(input_ids, params, routed_start):
        sent.append(list(input_ids))
        return GenerateResult(output_ids=ids(tok, "7") + [tok.eos_token_id], logprobs=[-1.0, -2.0],
                              finish_reason="stop", weight_version="3")

    ep = asyncio.run(run_episode(generate, FirstObservation(), None, ids(tok, prompt), renderer,
                                 TurnLimits(2, 50, 4), {}, tok.decode))
    # the observation sits between the prompt's message and the generation prompt
    assert ep.prompt_ids == ids(tok, "=3+4=5*") == sent[0]
    assert ep.response_ids == ids(tok, "7") + [tok.eos_token_id] and ep.loss_mask == [1.0, 1.0]
    assert (ep.turns, ep.end, ep.versions) == (1, "done", [3])


def test_a_first_observation_without_the_chat_template_is_appended(tok):
    renderer = ObservationRenderer(tok, apply_chat_template=False)
    obs = [{"role": "user", "content": "5"}]
    out = renderer.first_observation_ids(ids(tok, "3+4="), obs)
    assert out == ids(tok, "3+4=") + renderer.observation_ids(obs)


def test_proxy_mode_config_and_plan():
    from relax_slurm.config.env import EnvConfig
    from relax_slurm.config.rollout import RolloutConfig
    from relax_slurm.config.schema import TrainConfig
    from relax_slurm.errors import ConfigError
    from relax_slurm.launch.local import local_plan
    from relax_slurm.launch.roles import worker_spec

    with pytest.raises(ConfigError, match="unset env.name"):
        TrainConfig(run_dir="x", rollout=RolloutConfig(agent_mode="proxy"),
                    env=EnvConfig(name="tool"))
    with pytest.raises(ConfigError, match="rollout.agent_mode='agent'"):
        RolloutConfig(agent_mode="agent")
    cfg = TrainConfig(run_dir="x", rollout=RolloutConfig(agent_mode="proxy", proxy_port=8123))
    plan = local_plan(cfg)
    assert plan.proxy_url == "http://127.0.0.1:8123"
    assert worker_spec(cfg, plan, Path("x"), "127.0.0.1").ports == {"proxy": 8123}
    assert local_plan(TrainConfig(run_dir="x")).proxy_url is None


def test_a_sessions_tools_go_to_the_templates_tools_section(tok):
    from relax_slurm.data.chat import render

    messages = [{"role": "user", "content": "1+1"}]
    assert render(tok, messages, True, tools=None) == "=1+1*"
    marked = tok.chat_template
    try:  # a template that lists tool names first, as Qwen's lists their schemas
        tok.chat_template = ("{%- for t in tools or [] -%}{{- t['function']['name'] + ' ' -}}"
                             "{%- endfor -%}" + marked)
        req = parse_chat_request({"messages": messages, "tools": [
            {"type": "function", "function": {"name": "11", "parameters": {}}}]})
        assert render(tok, req.messages, True, tools=req.tools) == "11 =1+1*"
    finally:
        tok.chat_template = marked


def test_on_slurm_the_proxy_is_on_the_first_rollout_node():
    from relax_slurm.launch import slurm_driver as drv
    from relax_slurm.launch.slurm_env import SlurmAllocation
    from relax_slurm.launch.submit import compose_config

    cfg = compose_config(["experiment=tiny_proxy_cpu", "cluster=slurm",
                          "run_dir=/tmp/relax-unit-run"])
    alloc = SlurmAllocation(job_id="41", het_groups=(("t1",), ("r1", "r2")), is_het=True)
    layout = drv.make_layout(cfg, alloc)
    plan = drv.slurm_plan(cfg, layout)
    assert plan.proxy_url.startswith("http://r1:")
    specs = {s.name: s for s in drv.role_specs(cfg, plan, layout, Path("/runs/x"))}
    assert specs["rollout"].host == "r1"
    assert specs["rollout"].ports == {"proxy": int(plan.proxy_url.rsplit(":", 1)[1])}
