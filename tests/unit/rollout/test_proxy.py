"""The agent proxy as it runs (rollout.agent_mode=proxy): a real hf engine, a real broker and
the rollout worker process serving the proxy; a scripted agent talks plain OpenAI HTTP to it.

The trajectories the broker receives are checked against what the agent saw (each model span
decodes to the reply it got, each mask-0 span to the turn's closing and the agent's message)
and against the engine itself (each model span is what the engine samples again from the same
ids and seed), and the HTTP errors are checked on the same processes."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers_tiny import REPO_ROOT, child_env, free_port, start_engine, stop_process, wait_healthy
from relax_slurm.auth import SECRET_ENV
from relax_slurm.broker import BrokerClient
from relax_slurm.config import save_config
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.env import EnvConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.data import load_tokenizer
from relax_slurm.runtime.plan import RunPlan, save_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
N = 2  # sessions per group
MAX_TOKENS = 4
QUESTIONS = {"q0": "1+2=", "q1": "3+4="}
SECRET = "proxy-test-secret"
KEY = {"Authorization": f"Bearer {SECRET}"}  # the run's secret is the proxy's API key


def start_broker(run_dir: Path) -> tuple[subprocess.Popen, str]:
    log = run_dir / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relax_slurm.broker", "--config", str(run_dir / "config.yaml"),
             "--router", "tcp://127.0.0.1:*", "--pub", "tcp://127.0.0.1:*"],
            cwd=REPO_ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(r"router=(\S+) pub=(\S+)", log.read_text())
        if m:
            return proc, m[1]
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    stop_process(proc)
    raise AssertionError(f"broker did not start:\n{log.read_text()}")


@pytest.fixture(scope="module")
def run(tiny_assets, tmp_path_factory):
    """(proxy url, engine url, broker router, tokenizer) of one proxy-mode rollout worker."""
    with pytest.MonkeyPatch.context() as mp:
        # relax-train hands every role the run's secret; the broker refuses requests without it
        mp.setenv(SECRET_ENV, SECRET)
        yield from _proxy_run(tiny_assets, tmp_path_factory)


def _proxy_run(tiny_assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("proxy")
    cfg = TrainConfig(
        run_dir=str(run_dir), model=ModelConfig(path=str(tiny_assets / "model")),
        algo=AlgoConfig(max_staleness=0),
        rollout=RolloutConfig(agent_mode="proxy", batch_size=2, n_samples_per_prompt=N,
                              max_new_tokens=8, proxy_admission_timeout_s=3.0),
        data=DataConfig(train_files=[str(tiny_assets / "arith_train.jsonl")]),
        env=EnvConfig(max_turns=3, max_total_tokens=40))
    save_config(cfg, run_dir / "config.yaml")
    procs = []
    try:
        broker, router = start_broker(run_dir)
        procs.append(broker)
        port, engine_log = free_port(), run_dir / "engine.log"
        procs.append(start_engine(tiny_assets / "model", port, engine_log))
        engine = f"http://127.0.0.1:{port}"
        proxy = f"http://127.0.0.1:{free_port()}"
        save_plan(RunPlan(broker_router=router, broker_pub="tcp://127.0.0.1:1",
                          engine_urls=[engine], proxy_url=proxy), run_dir)
        worker_log = run_dir / "rollout.log"
        with open(worker_log, "wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "relax_slurm.rollout", "--run-dir", str(run_dir)],
                cwd=REPO_ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        procs.append(worker)
        wait_healthy(engine, procs[1], timeout_s=200, log_path=engine_log)
        wait_healthy(proxy, worker, timeout_s=200, log_path=worker_log)
        yield proxy, engine, router, load_tokenizer(tiny_assets / "model")
    finally:
        for p in reversed(procs):
            stop_process(p)


def chat(client, url, messages, seed, **extra):
    return client.post(url + "/v1/chat/completions",
                       json={"model": "policy", "messages": messages, "max_tokens": MAX_TOKENS,
                             "seed": seed, **extra})


def play(client, proxy, group, name, seed0):
    """Three turns of "answer, get '+' back": the replies and the seeds used."""
    url = f"{proxy}/s/{group}/{name}"
    messages, replies, seeds = [{"role": "user", "content": QUESTIONS[group]}], [], []
    for turn in range(3):
        seeds.append(seed0 + turn)
        r = chat(client, url, messages, seeds[-1], logprobs=True)
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        content = choice["message"]["content"]
        assert choice["finish_reason"] in ("stop", "length") and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == len(choice["logprobs"]["content"]) >= 1
        replies.append(content)
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "+"}]
    return replies, seeds


def spans(mask):
    """[(start, end, value)] of the runs of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_a_scripted_agent_produces_trainable_trajectories(run):
    proxy, engine, router, tok = run
    played = {}
    with httpx.Client(timeout=60, headers=KEY) as client, \
            BrokerClient(router, timeout_s=30) as broker:
        broker.set_version(0)  # as the trainer does once the engines hold its weights
        check_errors(client, proxy, broker)
        for g, group in enumerate(QUESTIONS):
            for i, name in enumerate(("a", "b")):
                played[group, name] = play(client, proxy, group, name, seed0=100 * (2 * g + i))
                r = client.post(f"{proxy}/s/{group}/{name}/reward", json={"reward": float(i)})
                assert r.status_code == 200 and r.json()["group_complete"] == (i == N - 1)
        # the staleness bound: both credits of version 0 are used, a third group waits, 503
        r = chat(client, f"{proxy}/s/q2/a", [{"role": "user", "content": "1+1="}], 1)
        assert r.status_code == 503 and "admission" in r.json()["error"]["message"]
        batch = broker.get_batch(2, version=0, wait_s=30)
    assert batch is not None
    groups, _ = batch
    assert sorted(g[0].prompt_id for g in groups) == ["q0", "q1"]
    with httpx.Client(base_url=engine, timeout=60) as eng:
        for group in groups:
            assert [s.reward for s in group] == [0.0, 1.0]
            for sample, name in zip(group, ("a", "b")):
                check_sample(sample, *played[sample.prompt_id, name], tok, eng)


def check_sample(sample, replies, seeds, tok, engine):
    prompt = sample.prompt_ids.tolist()
    assert prompt == tok(QUESTIONS[sample.prompt_id], add_special_tokens=False)["input_ids"]
    ids, mask = sample.response_ids.tolist(), sample.loss_mask.tolist()
    lps = sample.rollout_logprobs.tolist()
    runs = spans(mask)
    model = [(a, b) for a, b, m in runs if m == 1.0]
    between = [(a, b) for a, b, m in runs if m == 0.0]
    # three model turns, separated by the turn's closing and the agent's "+" (mask 0)
    assert len(model) == 3 and len(between) == 2 and runs[0][2] == 1.0
    for (a, b), reply in zip(model, replies):
        assert tok.decode(ids[a:b], skip_special_tokens=True) == reply
        assert all(lp < 0 for lp in lps[a:b])
    for a, b in between:
        assert tok.decode(ids[a:b], skip_special_tokens=True) == "+"
        assert all(lp == 0 for lp in lps[a:b])
    # token in == token out: each model span is what the engine samples from the ids before it
    for (a, b), seed in zip(model, seeds):
        r = engine.post("/generate", json={
            "input_ids": prompt + ids[:a], "return_logprob": True,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 1.0, "top_p": 1.0,
                                "top_k": -1, "sampling_seed": seed}})
        out = [int(e[1]) for e in r.json()["meta_info"]["output_token_logprobs"]]
        assert out == ids[a:b]
    assert sample.version == sample.version_min == 0
    assert sample.metadata["turns"] == 3 and sample.metadata["agent_group"] == sample.prompt_id


def check_errors(client, proxy, broker):
    """Every refusal is a clear HTTP error; a dropped group gives its credit back."""
    url = f"{proxy}/s/errs/x"
    first = [{"role": "user", "content": "2+2="}]
    for key in ({}, {"Authorization": "Bearer wrong"}):  # training data only from the run's owner
        r = httpx.post(url + "/v1/chat/completions", json={"messages": first}, headers=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_api_key"
    assert httpx.get(f"{proxy}/health").status_code == 200  # open, for readiness checks
    r = client.post(url + "/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert client.post(f"{proxy}/s/nope/x/reward", json={"reward": 1}).status_code == 404
    r = chat(client, url, first, 1)
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]["message"]["content"]
    r = chat(client, url, [*first, {"role": "assistant", "content": reply + "9"},
                           {"role": "user", "content": "+"}], 2)
    assert r.status_code == 409 and "differs" in r.json()["error"]["message"]
    long = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "1" * 40}]
    r = chat(client, url, long, 2)
    assert r.status_code == 400 and r.json()["error"]["type"] == "context_length_exceeded"
    assert chat(client, f"{proxy}/s/errs/y", first, 3).status_code == 200
    r = chat(client, f"{proxy}/s/errs/z", first, 4)
    assert r.status_code == 409 and "n_samples_per_prompt" in r.json()["error"]["message"]
    assert client.post(f"{url}/reward", json={"reward": "high"}).status_code == 400
    before = broker.stats().counters.in_flight
    assert client.delete(url).status_code == 200
    assert broker.stats().counters.in_flight == before - 1
    r = chat(client, f"{proxy}/s/errs/y", first, 3)
    assert r.status_code == 409 and "already sent or dropped" in r.json()["error"]["message"]
    assert client.get(f"{proxy}/stats").json()["groups_dropped"] == 1
