"""The proxy's group bookkeeping in process, on a real proxy-mode RolloutWorker whose engine and
broker are replaced as in test_worker.py (the broker's real state machine): one request at a
time per session, the admission bound, idle groups dropped, dynamic sampling, engine failures.
The same routes against real processes: test_proxy.py."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from helpers_tiny import free_port

from relax_slurm.broker.state import BrokerState
from relax_slurm.config import save_config
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.env import EnvConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.errors import EngineError
from relax_slurm.runtime.plan import RunPlan, save_plan
from relax_slurm.engines.client import GenerateResult
from relax_slurm.rollout.openai_chat import ProxyError
from relax_slurm.rollout.proxy import AgentProxy
from relax_slurm.rollout.proxy_server import serve_proxy
from relax_slurm.rollout.worker import RolloutWorker
from relax_slurm.routing.shape import RoutingShape, encode_routed_experts

ASK = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}


class Engine:
    """Answers "2<eos>"; waits for `gate` when one is set; raises when `fail` is set."""

    def __init__(self) -> None:
        self.gate: asyncio.Event | None = None
        self.fail = False
        self.starts: list[int] = []

    async def generate(self, input_ids, params, routed_start=0):
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise EngineError("engine http://x/generate: HTTP 500: boom")
        self.starts.append(routed_start)
        # an MoE engine's report (test_routed_experts_of_sessions): position p of the request
        # with start s routed to experts (s % 8, p % 8) in its two layers
        return [GenerateResult(output_ids=[5, 1], logprobs=[-0.5, -0.1], finish_reason="stop",
                               weight_version="0", routed_start=routed_start,
                               routed_experts=encode_routed_experts(np.array(
                                   [[routed_start % 8, p % 8]
                                    for p in range(routed_start, len(ids) + 1)], np.int32)))
                for ids in input_ids]


class Broker:
    """The broker's state machine in process; a parked acquire is a short sleep."""

    def __init__(self, batch_size: int) -> None:
        self.state = BrokerState(max_staleness=0, batch_size=batch_size)
        self.groups: list = []

    async def acquire(self, max_n, wait_s=0.0):
        granted = self.state.admit(max_n)
        if not granted:
            await asyncio.sleep(min(wait_s, 0.05))
        return granted

    async def put_group(self, group):
        self.state.accept(group)
        self.groups.append(group)

    async def release(self, n):
        self.state.release(n)

    async def heartbeat(self, role, **info):
        pass

    def close(self):
        pass


@pytest.fixture
def proxy(tmp_path, tiny_model_dir):
    made = []

    def make(batch_size: int = 4, **algo) -> AgentProxy:
        cfg = TrainConfig(
            run_dir=str(tmp_path), model=ModelConfig(path=str(tiny_model_dir)),
            algo=AlgoConfig(**algo),
            rollout=RolloutConfig(agent_mode="proxy", batch_size=batch_size,
                                  n_samples_per_prompt=2, max_new_tokens=4,
                                  proxy_admission_timeout_s=0.3, proxy_session_timeout_s=0.2),
            data=DataConfig(train_files=["unused.jsonl"], apply_chat_template=False),
            env=EnvConfig(max_turns=2, max_total_tokens=32))
        save_config(cfg, tmp_path / "config.yaml")
        save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                          engine_urls=["http://127.0.0.1:3"], proxy_url="http://127.0.0.1:4"),
                  tmp_path)
        worker = RolloutWorker(cfg, tmp_path)
        assert worker.dataset is None  # proxy mode reads no data
        worker.services.broker.close()
        worker.services.broker = Broker(batch_size)
        worker.services.router.engines = [Engine()]
        made.append(worker)
        return worker.proxy()

    yield make
    for w in made:
        w.services.reward_pool.close()


def run(coro):
    return asyncio.run(coro)


def test_one_request_at_a_time_per_session(proxy):
    p = proxy()

    async def main():
        p.svc.router.engines[0].gate = gate = asyncio.Event()
        first = asyncio.create_task(p.chat("g", "a", ASK))
        await asyncio.sleep(0.05)
        with pytest.raises(ProxyError, match="still answering") as e:
            await p.chat("g", "a", ASK)
        assert e.value.status == 409
        with pytest.raises(ProxyError, match="still answering"):
            await p.end("g", "a", 1.0)
        gate.set()
        return await first

    assert run(main())["choices"][0]["message"]["content"] == "2"


def test_the_admission_bound_and_idle_groups(proxy):
    p = proxy(batch_size=1)  # one group in flight at version 0

    async def main():
        await p.chat("g0", "a", ASK)
        with pytest.raises(ProxyError, match="proxy_admission_timeout_s") as e:
            await p.chat("g1", "a", ASK)
        assert e.value.status == 503 and "g1" not in p.groups
        await asyncio.sleep(0.3)  # g0 idles past rollout.proxy_session_timeout_s
        await p.reap_idle()
        assert p.stats()["groups_dropped"] == 1 and p.svc.broker.state.in_flight == 0
        with pytest.raises(ProxyError, match="unknown session"):
            await p.end("g0", "a", 1.0)
        await p.chat("g1", "a", ASK)  # the credit came back

    run(main())


def test_dynamic_sampling_and_engine_failures(proxy):
    p = proxy(dynamic_sampling=True)

    async def main():
        for name in ("a", "b"):
            await p.chat("same", name, ASK)
        assert (await p.end("same", "a", 1.0))["group_complete"] is False
        # equal rewards: no advantage to learn from; dropped and its credit given back
        assert await p.end("same", "b", 1.0) == {"group_complete": True, "sessions_ended": 2,
                                                 "sent": False}
        assert p.svc.broker.groups == [] and p.svc.broker.state.in_flight == 0
        for name, reward in (("a", 0.0), ("b", 1.0)):
            await p.chat("mixed", name, ASK)
            await p.end("mixed", name, reward)
        [group] = p.svc.broker.groups
        assert [s.reward for s in group] == [0.0, 1.0]
        assert group[0].metadata["filtered_groups"] == 1  # the dropped group is counted
        p.svc.router.engines[0].fail = True
        with pytest.raises(ProxyError, match="boom") as e:
            await p.chat("broken", "a", ASK)
        assert e.value.status == 502
        with pytest.raises(ProxyError, match="no model turn") as e:
            await p.end("broken", "a", 1.0)
        assert e.value.status == 409

    run(main())


def test_requests_parked_for_a_credit_end_with_the_run(proxy):
    p = proxy(batch_size=1)
    p.cfg.rollout.proxy_admission_timeout_s = 60.0

    async def main():
        await p.chat("g0", "a", ASK)
        parked = asyncio.create_task(p.chat("g1", "a", ASK))
        await asyncio.sleep(0.1)
        assert not parked.done()
        p.closing.set()  # what serve_proxy does when the worker stops
        with pytest.raises(ProxyError, match="run is ending") as e:
            await asyncio.wait_for(parked, 1.0)
        assert e.value.status == 503
        with pytest.raises(ProxyError, match="run is ending"):
            await p.chat("g0", "a", ASK)

    run(main())


class DeadBroker(Broker):
    """A broker that stopped with the run: a put_group is received (`reached`) and never
    answered, as the real client's request waits for broker.request_timeout_s."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        self.reached = asyncio.Event()

    async def put_group(self, group):
        self.reached.set()
        await asyncio.Event().wait()


def test_a_reward_open_when_the_run_ends_is_answered_503_over_http(proxy):
    """The CI failure of session 16: the last session's reward reached a broker that had just
    stopped with the run; the request outlived the server's shutdown grace and uvicorn
    cancelled it with a bare 500, which the agent took for a bug. Now every open request
    answers 503 "the run is ending" as the worker stops (what an agent retries until the
    proxy is gone), and a retry is refused the same way."""
    p = proxy()
    p.svc.broker = DeadBroker(4)
    port = free_port()

    async def main():
        stop = asyncio.Event()
        server = asyncio.create_task(serve_proxy(p, stop, "rollout0", "127.0.0.1", port))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            while True:  # the server is up (serve_proxy would raise if it could not bind)
                assert not server.done(), server
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
            for name in ("a", "b"):
                assert (await http.post(f"/s/g/{name}/v1/chat/completions",
                                        json=ASK)).status_code == 200
            assert (await http.post("/s/g/a/reward", json={"reward": 1.0})).status_code == 200
            last = asyncio.create_task(http.post("/s/g/b/reward", json={"reward": 0.0}))
            await p.svc.broker.reached.wait()  # the group is on its way to the dead broker
            stop.set()  # what the worker's SIGTERM handler does
            r = await last
            assert r.status_code == 503, r.text
            assert "run is ending" in r.json()["error"]["message"]
            with pytest.raises(ProxyError, match="run is ending") as e:
                await p.end("g", "b", 0.0)  # a retry that reaches the proxy before it is gone
            assert e.value.status == 503
        await server

    run(main())


def test_routed_experts_of_sessions(proxy):
    """An MoE policy behind the proxy (its layout set by hand on the dense tiny model): each
    turn asks for the positions earlier turns did not cover, and every trained sample carries
    routing at all of its positions, each from the request that first processed it."""
    p = proxy(batch_size=1, routing_replay=True)
    p.svc.routing = RoutingShape(layers=2, topk=1, experts=8, moe_layers=(0, 1))
    engine = p.svc.router.engines[0]

    async def main():
        for name in ("a", "b"):
            first = await p.chat("g", name, ASK)
            reply = first["choices"][0]["message"]["content"]
            await p.chat("g", name, {"messages": [*ASK["messages"],
                                                  {"role": "assistant", "content": reply},
                                                  {"role": "user", "content": "again"}],
                                     "max_tokens": 2})
        for name in ("a", "b"):
            await p.end("g", name, 1.0 if name == "a" else 0.0)

    run(main())
    [group] = p.svc.broker.groups
    for sample in group:
        prompt, n = len(sample.prompt_ids), len(sample.prompt_ids) + sample.response_len - 1
        # turn 2 started at the first position turn 1 did not cover: its last output token
        assert engine.starts[:2] == [0, prompt + 1]
        rows = sample.routed_experts.reshape(n, 2).tolist()
        assert rows == [[0, q % 8] for q in range(prompt + 1)] + [
            [(prompt + 1) % 8, q % 8] for q in range(prompt + 1, n)]
        engine.starts = engine.starts[2:]
