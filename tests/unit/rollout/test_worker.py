"""The rollout worker's group pipeline with fake engines and an in-process broker state:
rewards through the pool (errors counted), dynamic sampling, overlong penalty, teacher log-probs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import textwrap

import numpy as np
import pytest
from transformers import AutoConfig

from tests.helpers_tiny import running_engine

from relax_slurm.broker.state import BrokerState
from relax_slurm.config import save_config
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.reward import RewardConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.errors import ConfigError, EngineUnreachable
from relax_slurm.modeling import media_token_ids
from relax_slurm.runtime.plan import RunPlan, save_plan
from relax_slurm.engines.client import EngineClient, GenerateResult
from relax_slurm.rollout.router import LeastLoadedRouter
from relax_slurm.rollout import worker as worker_module
from relax_slurm.rollout.multiturn import Episode
from relax_slurm.rollout.sampling import shaped_rewards
from relax_slurm.rollout.services import PendingCounts, make_engine
from relax_slurm.rollout.worker import RolloutWorker

EOS = 1  # helpers_tiny vocabulary: <pad>=0, <eos>=1, <unk>=2, digits from 3
PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4=", "5+5=", "6+6="]

# rewards the pool's workers import by module name: exact match, and an error on "0"; and
# one that scores once the test creates the file `gate` beside the module
REWARD_MODULE = textwrap.dedent("""
    import os
    import time

    GATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate")

    def grade(inp):
        if inp.response == "0":
            raise RuntimeError("cannot grade 0")
        return float(inp.response == inp.label)

    def gated(inp):
        while not os.path.exists(GATE):
            time.sleep(0.01)
        return 1.0
""")


class FakeEngine:
    """Answers every sample of a prompt from `answers[prompt text]` (one string per sample)."""

    url = "http://fake-engine:1"

    def __init__(self, tokenizer, answers: dict[str, list[str]]) -> None:
        self.tokenizer, self.answers = tokenizer, answers
        self.media: list = []
        self.params: list = []

    async def generate(self, input_ids, params, return_logprob=True, media=None,
                       routed_start=0):
        self.media.append(media)
        self.params.append(params)
        text = self.tokenizer.decode(input_ids[0])
        out = []
        for answer in self.answers[text][:len(input_ids)]:
            ids = self.tokenizer(answer)["input_ids"] + [EOS]
            out.append(GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids),
                                      finish_reason="stop", weight_version="0"))
        return out

    async def aclose(self):
        pass


class FakeTeacher:
    """Log-prob of token t is -t / 100 (position-coded, to check the alignment)."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.media: list = []
        self.exclude: tuple = ()

    async def prefill_logprobs(self, seqs, media=None, lengths=None, exclude=()):
        # a real engine expands one pad per item to the item's tokens: `lengths` long
        self.seen += seqs
        self.media.append(media)
        self.exclude = tuple(exclude)
        return [[-t / 100 for t in range(1, n)] for n in lengths or map(len, seqs)]

    async def aclose(self):
        pass


class FakeBroker:
    """The broker's real state machine in process; stops the worker after `stop_after` groups."""

    def __init__(self, worker: RolloutWorker, stop_after: int) -> None:
        self.state = BrokerState(max_staleness=0, batch_size=stop_after)
        self.worker, self.stop_after = worker, stop_after
        self.groups: list = []
        self.released = 0
        self.heartbeats: list = []

    async def acquire(self, max_n, wait_s=0.0):
        granted = self.state.admit(max_n)
        if not granted:
            await asyncio.sleep(0.01)
        return granted

    async def put_group(self, group):
        self.state.accept(group)
        self.groups.append(group)
        if len(self.groups) >= self.stop_after:
            self.worker.stop.set()

    async def release(self, n):
        self.state.release(n)
        self.released += n

    async def rejoin(self, rank):
        return {"reclaimed": self.state.reclaim(f"rollout{rank}"),
                "position": (None if self.state.positions.get(rank) is None
                             else self.state.positions.get(rank).to_dict())}

    async def heartbeat(self, role, **info):
        self.heartbeats.append((role, info))

    async def engines(self, drained=()):  # a fixed engine set (elastic rollout: no change)
        urls = [e.url for e in self.worker.services.router.engines]
        return {"routable": urls, "engines": [{"url": u, "state": "active"} for u in urls]}

    def close(self):
        pass


@pytest.fixture
def make_worker(tmp_path, tiny_model_dir, monkeypatch):
    module = f"worker_reward_{tmp_path.name}"
    (tmp_path / f"{module}.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": str(2 * (i + 1) % 10), "id": i})
                            + "\n" for i, p in enumerate(PROMPTS)))
    workers = []

    def make(teacher: bool = False, reward: str = "grade", **algo) -> RolloutWorker:
        cfg = TrainConfig(
            run_dir=str(tmp_path), model=ModelConfig(path=str(tiny_model_dir)),
            algo=AlgoConfig(**algo, teacher_model_path=str(tiny_model_dir) if teacher else None),
            rollout=RolloutConfig(batch_size=2, n_samples_per_prompt=4, max_new_tokens=3),
            data=DataConfig(train_files=[str(data)], apply_chat_template=False, shuffle=False),
            reward=RewardConfig(name=f"{module}:{reward}", num_workers=2, timeout_s=30.0),
        )
        save_config(cfg, tmp_path / "config.yaml")
        save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                          engine_urls=["http://127.0.0.1:3"],
                          teacher_url="http://127.0.0.1:4" if teacher else None), tmp_path)
        worker = RolloutWorker(cfg, tmp_path)
        workers.append(worker)
        return worker

    yield make
    for w in workers:
        asyncio.run(w.aclose())
    sys.modules.pop(module, None)


def test_pending_counts_ride_on_the_next_group():
    counts = PendingCounts()
    counts.filtered_groups += 2
    counts.reward_errors += 3
    assert counts.take(1) == {"reward_errors": 4, "filtered_groups": 2}
    assert counts.take(0) == {"reward_errors": 0, "filtered_groups": 0}


def test_overlong_penalty_is_added_to_rewards():
    cfg = TrainConfig(run_dir="x", rollout=RolloutConfig(max_new_tokens=10),
                      algo=AlgoConfig(overlong_buffer_tokens=4, overlong_penalty_factor=2.0))
    assert shaped_rewards(cfg, [1.0, 1.0, 0.0, 1.0], [6, 8, 10, 12]) == [1.0, 0.0, -2.0, -1.0]
    off = TrainConfig(run_dir="x", rollout=RolloutConfig(max_new_tokens=10))
    assert shaped_rewards(off, [1.0, 0.0], [10, 10]) == [1.0, 0.0]


def test_overlong_buffer_must_fit_below_max_new_tokens():
    with pytest.raises(ConfigError, match="algo.overlong_buffer_tokens"):
        TrainConfig(run_dir="x", rollout=RolloutConfig(max_new_tokens=4),
                    algo=AlgoConfig(overlong_buffer_tokens=4))


def test_dynamic_sampling_drops_uniform_groups_and_refills(make_worker):
    async def main():
        worker = make_worker(dynamic_sampling=True)
        # 1+1= and 2+2= are all right / all wrong (filtered: credit released, next prompt
        # drawn); 3+3= and 4+4= are mixed; a "0" answer is a reward error scored 0
        worker.services.router = LeastLoadedRouter([FakeEngine(worker.services.tokenizer, {
            "1+1=": ["2"] * 4, "2+2=": ["5", "0", "5", "5"],
            "3+3=": ["6", "6", "0", "1"], "4+4=": ["8", "1", "1", "1"],
            "5+5=": ["0"] * 4, "6+6=": ["2"] * 4})])
        worker.services.broker.close()
        worker.services.broker = FakeBroker(worker, stop_after=2)
        await worker.run()
        return worker.services.broker

    broker = asyncio.run(main())
    assert broker.released == 2
    assert broker.heartbeats[0] == ("rollout", {"groups_in_flight": 0, "groups_requeued": 0,
                                                "requests_per_engine": {FakeEngine.url: 0},
                                                "requests_open": {FakeEngine.url: 0},
                                                "groups_by_phase": {},
                                                "reward_workers": {"busy": 0, "workers": 2,
                                                                   "s_per_response": None},
                                                "env_threads": None})  # single-turn
    assert sorted(g[0].prompt_id for g in broker.groups) == ["2", "3"]
    for g in broker.groups:
        assert len({s.reward for s in g}) > 1  # only informative groups reach the broker
        assert all(s.teacher_logprobs is None for s in g)
    by_id = {g[0].prompt_id: g for g in broker.groups}
    assert [s.reward for s in by_id["2"]] == [1.0, 1.0, 0.0, 0.0]
    # both filtered groups and the one error of "2+2=" are reported by the groups that were sent
    metas = [g[0].metadata for g in broker.groups]
    assert sum(m["filtered_groups"] for m in metas) == 2
    assert sum(m["reward_errors"] for m in metas) == 2
    assert broker.state.counters()["released"] == 2


def test_the_heartbeat_says_the_groups_wait_on_the_reward(make_worker, tmp_path):
    """Groups whose reward is slow show in the worker's heartbeat as scoring, with every reward
    worker busy, and the stall note built from it says the reward holds the batch back (a
    run with a slow reward said only "27 groups in flight, no engine request open")."""
    from relax_slurm.broker.stats import BrokerStatus, Counters
    from relax_slurm.launch.waiting import explain

    async def main():
        worker = make_worker(reward="gated")
        worker.cfg.cluster.restart.heartbeat_interval_s = 0.05
        worker.services.router = LeastLoadedRouter([FakeEngine(worker.services.tokenizer, {
            p: ["2", "4", "6", "8"] for p in PROMPTS})])
        worker.services.broker.close()
        broker = worker.services.broker = FakeBroker(worker, stop_after=2)
        run = asyncio.create_task(worker.run())

        async def scoring() -> dict:
            while True:
                assert not run.done(), run
                for _, info in broker.heartbeats:
                    if (info["groups_by_phase"] == {"scoring": 2}
                            and info["reward_workers"]["busy"] == 2):
                        return info
                await asyncio.sleep(0.02)

        seen = await asyncio.wait_for(scoring(), 120)  # the reward workers' start included
        (tmp_path / "gate").touch()  # now the reward answers
        await asyncio.wait_for(run, 120)
        return broker, seen, worker.services.phases.snapshot()

    broker, seen, after = asyncio.run(main())
    assert len(broker.groups) == 2 and after == {}  # each phase counted out again
    assert seen["reward_workers"]["workers"] == 2
    counters = Counters.zero()
    counters.in_flight = 2
    line = explain(BrokerStatus(
        counters=counters, max_staleness=0, batch_size=2, admission_open=True,
        parked_acquires=0, parked_get_batch=1, auth_refused=0, uptime_s=9.0, pid=1,
        roles={"trainer": {"heartbeat_age_s": 1.0, "waiting": {"batch": {"version": 0}}},
               "rollout": {**seen, "heartbeat_age_s": 0.0}}))
    assert ("rollout: 2 groups in flight (2 scoring rewards), no engine request open, reward "
            "workers 2 of 2 busy: the reward is what the batch waits on; raise "
            "reward.num_workers") in line, line


def test_without_dynamic_sampling_every_group_is_sent_with_teacher_logprobs(make_worker):
    async def main():
        worker = make_worker(teacher=True)
        worker.services.router = LeastLoadedRouter([FakeEngine(worker.services.tokenizer, {
            p: ["2", "12", "2", "2"] for p in PROMPTS})])
        worker.services.teacher = FakeTeacher()
        worker.services.broker.close()
        worker.services.broker = FakeBroker(worker, stop_after=2)
        await worker.run()
        return worker

    worker = asyncio.run(main())
    broker = worker.services.broker
    assert broker.released == 0 and len(broker.groups) == 2
    by_id = {g[0].prompt_id: g for g in broker.groups}
    assert sorted(by_id) == ["0", "1"]  # the first two prompts (no shuffle), uniform or not
    assert [s.reward for s in by_id["0"]] == [1.0, 0.0, 1.0, 1.0]
    assert [s.reward for s in by_id["1"]] == [0.0] * 4
    for g in broker.groups:
        for s in g:
            P, R = len(s.prompt_ids), s.response_len
            # response token j sits at sequence position P + j, scored -(P + j) / 100
            expected = -np.arange(P, P + R, dtype=np.float32) / 100
            np.testing.assert_allclose(s.teacher_logprobs, expected, rtol=1e-6)
    sent = [list(s.prompt_ids) + list(s.response_ids) for g in broker.groups for s in g]
    assert sorted(worker.services.teacher.seen) == sorted(sent)


def test_a_teacher_path_without_a_teacher_engine_fails_at_start(make_worker, tmp_path):
    with pytest.raises(ConfigError, match="teacher"):
        worker = make_worker(teacher=True)
        save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                          engine_urls=["http://127.0.0.1:3"]), tmp_path)
        RolloutWorker(worker.cfg, tmp_path)


def test_sampling_doctests():
    import doctest

    from relax_slurm.rollout import sampling

    assert doctest.testmod(sampling).failed == 0


@pytest.mark.parametrize("kind", ["hf", "sglang"])
def test_multimodal_prompts_carry_processed_media(tmp_path, tiny_mm_assets, kind):
    """Image rows: the engine gets the prompt's own ids (one pad per image: it expands them,
    as SGLang's Qwen-VL processors require) and the image file; every sample of the group
    carries the same processed tensors (one set of arrays) and the expanded prompt. An SGLang
    engine is told never to sample the media pads (logit_bias), which the hf engine never does
    anyway: its log-probs are then over the trainer's tokens (#33)."""
    data = tmp_path / "mm.jsonl"
    data.write_text("".join(json.dumps({"prompt": "<image>=", "label": str(i),
                                        "images": [str(tiny_mm_assets / "colors" / f)],
                                        "id": i}) + "\n"
                            for i, f in enumerate(["red_0.png", "blue_1.png"])))
    model = tiny_mm_assets / "vl_model"
    cfg = TrainConfig(
        run_dir=str(tmp_path), model=ModelConfig(path=str(model)),
        rollout=RolloutConfig(engine=kind, batch_size=2, n_samples_per_prompt=2,
                              max_new_tokens=2),
        data=DataConfig(train_files=[str(data)], shuffle=False,
                        multimodal_keys={"image": "images"}),
        reward=RewardConfig(name="exact_match", num_workers=1, timeout_s=30.0))
    save_config(cfg, tmp_path / "config.yaml")
    save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                      engine_urls=["http://127.0.0.1:3"]), tmp_path)

    async def main():
        worker = RolloutWorker(cfg, tmp_path)
        try:
            pad = worker.services.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            sent = worker.services.tokenizer.decode(worker.dataset[0].input_ids)
            assert sent.count("<|image_pad|>") == 1
            engine = FakeEngine(worker.services.tokenizer, {sent: ["0", "1"]})
            worker.services.router = LeastLoadedRouter([engine])
            worker.services.broker.close()
            worker.services.broker = FakeBroker(worker, stop_after=2)
            await worker.run()
            return worker.services.broker.groups, engine.media, pad, engine.params
        finally:
            await worker.aclose()

    groups, media, pad, params = asyncio.run(main())
    biases = [p.get("logit_bias") for call in params for p in call]
    assert len(biases) == 4
    if kind == "sglang":  # the image and video pads of the tiny Qwen2.5-VL, probability 0
        assert all(b is not None and len(b) == 2 and b[str(pad)] <= -1e30 for b in biases), biases
    else:
        assert biases == [None] * 4
    files = [str((tiny_mm_assets / "colors" / f).resolve()) for f in ("blue_1.png", "red_0.png")]
    assert sorted(m[0]["image"][0] for m in media) == files and all(len(m) == 2 for m in media)
    for g in groups:
        assert list(g[0].prompt_ids).count(pad) == 4
        assert g[0].mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
        assert g[0].mm_inputs["pixel_values"] is g[1].mm_inputs["pixel_values"]
    rewards = {g[0].prompt_id: [s.reward for s in g] for g in groups}
    assert rewards == {"0": [1.0, 0.0], "1": [0.0, 1.0]}  # answers "0", "1"; labels 0 and 1


@pytest.mark.parametrize("kind", ["sglang", "hf"])
def test_a_vl_model_on_text_prompts_is_banned_from_sampling_its_media_pads(tmp_path,
                                                                           tiny_mm_assets, kind):
    """A multimodal model.path trained on text (no data.multimodal_keys): SGLang is still told
    never to sample the media pads, which the trainer's softmax leaves out whatever the data
    (#33: the ban came with the media processor, so text prompts went without it)."""
    data = tmp_path / "text.jsonl"
    data.write_text(json.dumps({"prompt": "=", "label": "0", "id": 0}) + "\n")
    model = tiny_mm_assets / "vl_model"
    cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path=str(model)),
                      rollout=RolloutConfig(engine=kind, batch_size=1, n_samples_per_prompt=2),
                      data=DataConfig(train_files=[str(data)], shuffle=False),
                      reward=RewardConfig(name="exact_match", num_workers=1, timeout_s=30.0))
    save_config(cfg, tmp_path / "config.yaml")
    save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                      engine_urls=["http://127.0.0.1:3"]), tmp_path)

    async def main():
        worker = RolloutWorker(cfg, tmp_path)
        try:
            return worker.services.group_params(0)
        finally:
            await worker.aclose()

    pads = media_token_ids(AutoConfig.from_pretrained(model))
    biases = [p.get("logit_bias") for p in asyncio.run(main())]
    if kind == "sglang":
        assert all(b == {str(t): -1e30 for t in pads} for b in biases), biases
    else:  # the hf engine never samples them, and takes logit_bias only at its default
        assert biases == [None, None]


def test_multimodal_samples_get_teacher_logprobs_of_the_expanded_prompt(tmp_path,
                                                                      tiny_mm_assets):
    """On-policy distillation of image prompts: the teacher prefills the prompt as the
    generating engine got it (one pad per image, SGLang's Qwen-VL processors refuse ids
    expanded by the caller) with the same image, plus the response; the response part of its
    log-probs, which cover the expanded sequence, lines up with the response tokens, and the
    model's media pads are left out of its softmax (as the trainer leaves them out)."""
    data = tmp_path / "mm.jsonl"
    data.write_text(json.dumps({"prompt": "<image>=", "label": "0", "id": 0,
                                "images": [str(tiny_mm_assets / "colors" / "red_0.png")]}) + "\n")
    model = tiny_mm_assets / "vl_model"
    cfg = TrainConfig(
        run_dir=str(tmp_path), model=ModelConfig(path=str(model)),
        algo=AlgoConfig(name="gspo", teacher_model_path=str(model)),
        rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=2, max_new_tokens=2),
        data=DataConfig(train_files=[str(data)], shuffle=False,
                        multimodal_keys={"image": "images"}),
        reward=RewardConfig(name="exact_match", num_workers=1, timeout_s=30.0))
    save_config(cfg, tmp_path / "config.yaml")
    save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                      engine_urls=["http://127.0.0.1:3"], teacher_url="http://127.0.0.1:4"),
              tmp_path)

    async def main():
        worker = RolloutWorker(cfg, tmp_path)
        try:
            sent = worker.services.tokenizer.decode(worker.dataset[0].input_ids)
            engine = FakeEngine(worker.services.tokenizer, {sent: ["0", "1"]})
            worker.services.router = LeastLoadedRouter([engine])
            worker.services.teacher = FakeTeacher()
            worker.services.broker.close()
            worker.services.broker = FakeBroker(worker, stop_after=1)
            await worker.run()
            return (worker.services.broker.groups, engine.media, worker.services.teacher,
                    list(worker.dataset[0].input_ids))
        finally:
            await worker.aclose()

    [group], media, teacher, unexpanded = asyncio.run(main())
    assert teacher.media == media  # the image the engine saw, per sequence
    assert len(unexpanded) == len(group[0].prompt_ids) - 3  # one pad, not the image's 4
    assert teacher.seen == [unexpanded + list(s.response_ids) for s in group]
    assert teacher.exclude == media_token_ids(AutoConfig.from_pretrained(model)) != ()
    for s in group:
        P, R = len(s.prompt_ids), s.response_len  # P counts the 4 expanded pads
        np.testing.assert_allclose(s.teacher_logprobs,
                                   -np.arange(P, P + R, dtype=np.float32) / 100, rtol=1e-6)


def test_multi_turn_episodes_get_teacher_logprobs_of_model_tokens_only(make_worker):
    """Episodes (env-driven or through the agent proxy) go through put_episodes: the teacher
    scores prompt + the whole response; environment tokens (mask 0) get 0."""
    async def main():
        worker = make_worker(teacher=True)
        worker.services.teacher = FakeTeacher()
        worker.services.broker.close()
        worker.services.broker = FakeBroker(worker, stop_after=1)
        episodes = [Episode(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11, 12],
                            loss_mask=[1, 1, 0, 0, 1], logprobs=[-0.1] * 5, versions=[0]),
                    Episode(prompt_ids=[5, 6], response_ids=[8, 9, 10],
                            loss_mask=[1, 0, 1], logprobs=[-0.1] * 3, versions=[0])]
        await worker.services.broker.acquire(1)  # the group's admission credit
        await worker.services.put_episodes("p", 0, episodes, [1.0, 0.0], 0, {})
        return worker

    worker = asyncio.run(main())
    [group] = worker.services.broker.groups
    # sequence position t is scored -t / 100; the response starts at position P
    assert group[0].teacher_logprobs.tolist() == pytest.approx([-0.03, -0.04, 0.0, 0.0, -0.07])
    assert group[1].teacher_logprobs.tolist() == pytest.approx([-0.02, 0.0, -0.04])
    assert worker.services.teacher.seen == [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 8, 9, 10]]


class FlakyEngine(FakeEngine):
    """Unreachable for its first `failures` calls (an engine restarting in place)."""

    def __init__(self, tokenizer, answers, failures: int) -> None:
        super().__init__(tokenizer, answers)
        self.failures, self.calls = failures, 0

    async def generate(self, input_ids, params, return_logprob=True, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise EngineUnreachable("engine http://127.0.0.1:3/generate: ConnectError: refused")
        return await super().generate(input_ids, params, return_logprob, **kwargs)


def run_two_groups(make_worker, make_engine, partial_rollout: bool = True) -> RolloutWorker:
    """A worker on make_engine(tokenizer, answers) until the broker has two groups."""
    async def main():
        worker = make_worker()
        worker.cfg.rollout.partial_rollout = partial_rollout
        engine = make_engine(worker.services.tokenizer, {p: ["2", "12", "2", "2"] for p in PROMPTS})
        worker.services.router = LeastLoadedRouter([engine])
        worker.services.broker.close()
        worker.services.broker = FakeBroker(worker, stop_after=2)
        await worker.run()
        return worker

    return asyncio.run(main())


def test_groups_of_an_unreachable_engine_are_requeued_with_their_credit(make_worker, monkeypatch):
    monkeypatch.setattr(worker_module, "ENGINE_RETRY_S", 0.01)

    worker = run_two_groups(make_worker, lambda tok, answers: FlakyEngine(tok, answers, 2))
    broker = worker.services.broker
    assert worker.requeued_total == 2
    # the same two prompts (with their group ids), not the next ones; no credit released
    assert sorted(g[0].prompt_id for g in broker.groups) == ["0", "1"]
    assert broker.released == 0 and broker.state.counters()["accepted"] == 2


class AbortingEngine(FakeEngine):
    """Its first `aborts` calls end like a sync in weight_sync.pause_mode=abort ends them: the
    tokens so far and finish_reason abort; later answers carry version spans (a retract)."""

    def __init__(self, tokenizer, answers, aborts: int) -> None:
        super().__init__(tokenizer, answers)
        self.aborts, self.calls = aborts, 0

    async def generate(self, input_ids, params, return_logprob=True, **kwargs):
        self.calls += 1
        out = await super().generate(input_ids, params, return_logprob, **kwargs)
        if self.calls <= self.aborts:
            return [dataclasses.replace(r, output_ids=r.output_ids[:1], logprobs=r.logprobs[:1],
                                        finish_reason="abort") for r in out]
        return [dataclasses.replace(r, weight_version="4",
                                    weight_versions=[("3", 0, 1), ("4", 1, len(r.output_ids))])
                for r in out]


def test_aborted_groups_are_requeued_never_scored_and_spans_give_the_versions(make_worker):
    """rollout.partial_rollout=false: an aborted group is generated again from scratch."""
    worker = run_two_groups(make_worker, lambda tok, answers: AbortingEngine(tok, answers, 2),
                            partial_rollout=False)
    groups = worker.services.broker.groups
    assert worker.requeued_total == 2
    assert sorted(g[0].prompt_id for g in groups) == ["0", "1"]  # the same prompts, again
    samples = [s for g in groups for s in g]
    assert all(s.finish_reason == "stop" and len(s.response_ids) > 1 for s in samples)
    # tokens from versions 3 and 4: the staleness rule judges the oldest
    assert {(s.version_min, s.version) for s in samples} == {(3, 4)}
    assert all(s.version_spans == [[3, 0, 1], [4, 1, s.response_len]] for s in samples)
    assert worker.services.broker.released == 0


def test_a_managed_judge_is_called_at_the_plan_url_and_waited_for(make_worker, tmp_path,
                                                                   monkeypatch):
    worker = make_worker()
    cfg = dataclasses.replace(worker.cfg, reward=RewardConfig(
        name="genrm", genrm_model_path=str(tmp_path / "judge"), timeout_s=60.0))
    judge = "http://127.0.0.1:5"
    save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                      engine_urls=["http://127.0.0.1:3"], genrm_url=judge), tmp_path)
    managed = RolloutWorker(cfg, tmp_path)
    try:
        assert managed.services.reward.cfg.genrm_url == judge  # what the reward processes call
        waited: list[list[str]] = []
        monkeypatch.setattr(worker_module, "wait_until_healthy",
                            lambda urls, timeout_s, **_: waited.append(list(urls)))
        asyncio.run(managed.wait_for_engines())
        assert waited == [["http://127.0.0.1:3", judge]]
        save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                          engine_urls=["http://127.0.0.1:3"]), tmp_path)
        with pytest.raises(ConfigError, match="no judge engine"):
            RolloutWorker(cfg, tmp_path)
    finally:
        asyncio.run(managed.aclose())


def test_an_engine_behind_the_broker_gets_no_requests_until_it_serves_the_floor(make_worker,
                                                                                 tiny_model_dir,
                                                                                 tmp_path):
    """A real hf engine serving version 0 (restarted, say) while the broker is at version 3
    with max_staleness 0: its first answer is older than the floor, the worker's gate marks
    it behind (rollout/version_gate.py), and no request goes to it any more, so the groups
    dropped as stale are only those in flight then, at most the credits the broker granted:
    (max_staleness + version + 1) * batch_size = 8. Relabelled 3 (the trainer's re-sync), it
    is routed to again and its groups are accepted. Before, every dropped group freed a credit
    for another one at version 0, as fast as the engine generated."""
    with running_engine(tiny_model_dir, tmp_path) as url:
        async def main() -> FakeBroker:
            worker = make_worker()
            svc, gate = worker.services, worker.services.router.gate
            svc.router = LeastLoadedRouter([make_engine(svc.cfg, url, False, gate)], gate)
            svc.broker.close()
            broker = svc.broker = FloorBroker(worker, stop_after=2, version=3)
            run = asyncio.create_task(worker.run())
            while not (gate.behind and broker.state.dropped >= 1):
                assert not run.done(), run
                await asyncio.sleep(0.05)
            with EngineClient(url, 30.0) as client:
                await asyncio.to_thread(client.update_weight_version, "3")
            await asyncio.wait_for(run, 120)
            for engine in svc.router.engines:  # in this loop: the fixture closes the rest later
                await engine.aclose()
            svc.router.engines = []
            return broker

        broker = asyncio.run(main())
    assert 1 <= broker.state.dropped <= (0 + 3 + 1) * 2, broker.state.counters()
    fresh = [g for g in broker.groups if g[0].version == 3]
    assert len(fresh) >= 2 and all(s.version_min == 3 for g in fresh for s in g)


class FloorBroker(FakeBroker):
    """FakeBroker at `version`, telling the worker its floor as the broker's client does."""

    def __init__(self, worker: RolloutWorker, stop_after: int, version: int) -> None:
        super().__init__(worker, stop_after)
        self.state.version = version
        self.floor = version - self.state.max_staleness

    async def put_group(self, group):
        self.state.accept(group)
        self.groups.append(group)
        if sum(g[0].version == self.state.version for g in self.groups) >= self.stop_after:
            self.worker.stop.set()
