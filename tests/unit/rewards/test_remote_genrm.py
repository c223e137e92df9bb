"""`remote` and `genrm` against a real HTTP server of the test's own on a free local port."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from relax_slurm.config.reward import RewardConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.rewards import genrm as genrm_module
from relax_slurm.errors import ConfigError
from relax_slurm.runtime.plan import RunPlan
from relax_slurm.runtime.ports import free_port
from relax_slurm.rewards import RewardError, RewardInput, build_reward, score
from relax_slurm.rewards.genrm import DEFAULT_TEMPLATE, EngineJudge, GenRM, render
from relax_slurm.rewards.remote import RemoteReward
from tests.helpers_broker import wait_for
from tests.helpers_http import Server, judge_engine

INP = RewardInput(prompt="2+2?", response="<think>easy</think>4", label="4",
                  metadata={"id": 1})


def test_remote_posts_the_sample_and_reads_the_reward(serve):
    server = serve(lambda path, body: (200, {"reward": 0.75}))
    cfg = RewardConfig(name="remote", remote_url=server.url + "/score")
    assert build_reward(cfg)(INP) == 0.75
    path, body = server.requests[0]
    assert path == "/score"
    assert body == {"prompt": "2+2?", "response": "<think>easy</think>4", "label": "4",
                    "metadata": {"id": 1}}
    assert score("remote", "x", "y", cfg=cfg) == 0.75


def test_remote_retries_503_with_backoff(serve):
    answers = iter([(503, {"error": "busy"}), (503, {"error": "busy"}), (200, 1.0)])
    server = serve(lambda path, body: next(answers))
    reward = RemoteReward(server.url, timeout_s=5.0, max_retries=3, backoff_s=0.05)
    start = time.perf_counter()
    assert reward(INP) == 1.0
    assert len(server.requests) == 3
    assert time.perf_counter() - start >= 0.05 + 0.1  # waited 0.05 then 0.1


def test_remote_gives_up_after_the_retries(serve):
    server = serve(lambda path, body: (500, {"error": "down"}))
    reward = RemoteReward(server.url, timeout_s=5.0, max_retries=2, backoff_s=0.01)
    with pytest.raises(RewardError, match="failed 3 times.*HTTP 500"):
        reward(INP)
    assert len(server.requests) == 3


def test_remote_does_not_retry_a_client_error(serve):
    server = serve(lambda path, body: (422, {"detail": "bad label"}))
    with pytest.raises(RewardError, match="HTTP 422"):
        RemoteReward(server.url, max_retries=3, backoff_s=0.01)(INP)
    assert len(server.requests) == 1


def test_remote_times_out_each_attempt(serve):
    def slow_after_the_first(path, body):
        if body["prompt"] != "warm-up":
            time.sleep(5.0)
        return 200, 1.0

    server = serve(slow_after_the_first)
    reward = RemoteReward(server.url, timeout_s=0.3, max_retries=1, backoff_s=0.01)
    assert reward(RewardInput(prompt="warm-up", response="", label="")) == 1.0  # client set up
    start = time.perf_counter()
    with pytest.raises(RewardError, match="ReadTimeout"):
        reward(INP)
    # two attempts cut at 0.3 s each, not two 5 s waits
    assert time.perf_counter() - start < 4.0
    # the server notes a request in its handler thread, which a client that gave up at 0.3 s
    # may outrun on a loaded machine: the third arrives, but is counted a moment later
    wait_for(lambda: len(server.requests) == 3)


def test_remote_without_a_server_is_an_error(serve):
    server = serve(lambda path, body: (200, 1.0))
    url = server.url
    server.close()  # nothing listens there any more
    with pytest.raises(RewardError, match="ConnectError"):
        RemoteReward(url, timeout_s=1.0, max_retries=1, backoff_s=0.01)(INP)


def test_remote_rejects_an_answer_without_a_number(serve):
    server = serve(lambda path, body: (200, {"verdict": "good"}))
    with pytest.raises(RewardError, match="no numeric reward"):
        RemoteReward(server.url)(INP)


def test_genrm_through_an_engine(serve):
    server = serve(judge_engine("The response says 4, the reference is 4.\nYES"))
    cfg = RewardConfig(name="genrm", genrm_url=server.url, genrm_max_new_tokens=64,
                       genrm_timeout_s=5.0)
    assert build_reward(cfg)(INP) == 1.0
    _, body = server.requests[0]
    assert body["sampling_params"] == {"max_new_tokens": 64, "temperature": 0.0}
    assert "2+2?" in body["text"] and "easy" not in body["text"]  # reasoning left out
    assert body["text"] == render(DEFAULT_TEMPLATE, INP)


def test_genrm_score_parser_and_custom_template(serve):
    server = serve(judge_engine("Reasonable work. Score: 8"))
    cfg = RewardConfig(name="genrm", genrm_url=server.url, genrm_parser="score",
                       genrm_max_score=10.0, genrm_template=r"Q={prompt} A={response} \frac{1}{2}")
    assert build_reward(cfg)(INP) == pytest.approx(0.8)
    assert server.requests[0][1]["text"] == r"Q=2+2? A=4 \frac{1}{2}"


def test_genrm_unreadable_or_failing_judge_is_an_error(serve):
    server = serve(judge_engine("I cannot decide."))
    with pytest.raises(RewardError, match="YES/NO"):
        GenRM(EngineJudge(server.url, timeout_s=5.0))(INP)
    broken = serve(lambda path, body: (500, {"error": "oom"}))
    with pytest.raises(RewardError, match="HTTP 500"):
        GenRM(EngineJudge(broken.url, timeout_s=5.0))(INP)


def test_genrm_takes_any_judge_callable():
    seen = []

    def judge(prompt_text: str) -> str:
        seen.append(prompt_text)
        return "no"

    assert GenRM(judge, template="{label}|{response}")(INP) == 0.0
    assert seen == ["4|4"]


def test_genrm_url_and_model_path_are_exclusive():
    with pytest.raises(ConfigError, match="genrm_url=http://j:1 and reward.genrm_model_path=/m"):
        TrainConfig(run_dir="r", reward=RewardConfig(name="genrm", genrm_url="http://j:1",
                                                    genrm_model_path="/m"))
    with pytest.raises(ConfigError, match="genrm_model_path=DIR"):  # neither: both named
        build_reward(RewardConfig(name="dapo-genrm"))


def test_a_managed_judge_gets_its_url_from_the_plan_and_only_it_the_key(serve, monkeypatch):
    """The run's engine key goes to the judge relax-train serves, never to a judge the user
    runs (the key may be the run's own secret)."""
    monkeypatch.setenv("RELAX_ENGINE_API_KEY", "run-secret")
    server = serve(judge_engine("YES"))
    cfg = RewardConfig(name="genrm", genrm_model_path="/models/judge", genrm_timeout_s=5.0)
    plan = RunPlan(broker_router="tcp://h:1", broker_pub="tcp://h:2", genrm_url=server.url)
    resolved = plan.reward_config(cfg)
    assert resolved.genrm_url == server.url and resolved.genrm_model_path == "/models/judge"
    assert build_reward(resolved)(INP) == 1.0 and len(server.requests) == 1
    unmanaged = RewardConfig(name="genrm", genrm_url=server.url)
    assert plan.reward_config(unmanaged) is unmanaged
    assert build_reward(unmanaged)(INP) == 1.0
    for name in ("dapo-genrm", "dapo_rule_genrm"):  # the same client
        build_reward(RewardConfig(name=name, genrm_url=server.url))(INP)
    assert server.auth == ["Bearer run-secret", None, None, None]
    with pytest.raises(ConfigError, match="no judge engine"):
        RunPlan(broker_router="tcp://h:1", broker_pub="tcp://h:2").reward_config(cfg)


def test_genrm_waits_for_a_judge_restarting_within_its_timeout(monkeypatch):
    # a judge restarted in place does not listen for a few seconds: the call waits for it
    port = free_port()
    judge = EngineJudge(f"http://127.0.0.1:{port}", timeout_s=30.0)
    refused = threading.Event()  # the judge call found nothing listening and waits to retry

    def pause(seconds: float) -> None:
        refused.set()
        time.sleep(seconds)

    monkeypatch.setattr(genrm_module, "time", SimpleNamespace(monotonic=time.monotonic,
                                                              sleep=pause))
    up: list[Server] = []

    def bring_up() -> None:
        if refused.wait(30):
            up.append(Server(judge_engine("YES"), port))

    thread = threading.Thread(target=bring_up, daemon=True)
    thread.start()
    try:
        assert GenRM(judge)(INP) == 1.0 and refused.is_set()
        with pytest.raises(RewardError):  # nothing listens and the budget is spent
            EngineJudge(f"http://127.0.0.1:{free_port()}", timeout_s=0.2)("x")
    finally:
        thread.join(30)
        for s in up:
            s.close()


def test_genrm_repeats_a_call_the_judge_dropped(serve):
    # a judge killed mid-call closes the connection without an answer: the call is repeated
    dropped: list[bool] = []

    def reply(path: str, body: dict) -> tuple[int, object]:
        if not dropped:
            dropped.append(True)
            raise ConnectionAbortedError("the judge died mid-call")
        return judge_engine("YES")(path, body)

    server = serve(reply)
    assert GenRM(EngineJudge(server.url, timeout_s=30.0))(INP) == 1.0
    assert len(server.requests) == 2
