"""A stopped rollout worker exits even when its broker or engines are gone.

A launcher killed outright takes every role with it at once (PR_SET_PDEATHSIG): the worker's
SIGTERM can arrive while it waits for engines that will never answer, or while a call to a
broker that already exited is parked for broker.request_timeout_s. Both waits are set to
600 s here, so a worker that exits within the bound below did not sit them out (a clean-clone
CI run once saw the worker outlive its launcher by a minute).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from relax_slurm.config import save_config
from relax_slurm.config.broker import BrokerConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.reward import RewardConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.runtime.plan import RunPlan, save_plan
from relax_slurm.rollout.worker import STOP_GRACE_S
from tests.helpers_tiny import (
    REPO_ROOT, child_env, free_port, start_engine, stop_process, wait_healthy,
)

NEVER_S = 600.0  # the waits a stopped worker must not sit out
# the grace, then closing its reward pool and sockets; far below NEVER_S on any machine
EXIT_BOUND_S = STOP_GRACE_S + 60.0
START_BOUND_S = 120.0


def start_worker(run_dir: Path, model_dir: Path, broker_router: str,
                 engine_url: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    data = run_dir / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    cfg = TrainConfig(
        run_dir=str(run_dir), model=ModelConfig(path=str(model_dir)),
        rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=2, max_new_tokens=4,
                              startup_timeout_s=NEVER_S),
        data=DataConfig(train_files=[str(data)], apply_chat_template=False),
        reward=RewardConfig(name="exact_match", num_workers=1),
        broker=BrokerConfig(request_timeout_s=NEVER_S))
    save_config(cfg, run_dir / "config.yaml")
    save_plan(RunPlan(broker_router=broker_router, broker_pub=f"tcp://127.0.0.1:{free_port()}",
                      engine_urls=[engine_url]), run_dir)
    log = (run_dir / "rollout.log").open("wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "relax_slurm.rollout", "--run-dir", str(run_dir)],
            cwd=REPO_ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    finally:
        log.close()


def wait_until(cond, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + START_BOUND_S
    while not cond():
        assert proc.poll() is None, f"the worker exited before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} in time:\n{log.read_text()}"
        time.sleep(0.1)


def assert_stops(proc: subprocess.Popen, log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker outlived SIGTERM by {EXIT_BOUND_S} s:\n{log.read_text()}")
    assert rc == 0, log.read_text()


def test_a_worker_waiting_for_dead_engines_stops_on_sigterm(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    proc = start_worker(run_dir, tiny_model_dir, f"tcp://127.0.0.1:{free_port()}",
                        f"http://127.0.0.1:{free_port()}")  # nothing listens there
    log = run_dir / "rollout.log"
    try:
        wait_until(lambda: "waiting for the engines" in log.read_text(), proc, log,
                   "wait for the engines")
        assert_stops(proc, log)
    finally:
        stop_process(proc)


def test_a_worker_parked_on_a_dead_broker_stops_on_sigterm(tmp_path, tiny_model_dir):
    """The broker here is a socket that takes the worker's first request and never answers,
    as a broker that exited after receiving it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = start_engine(tiny_model_dir, port, tmp_path / "engine.log")
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    router_port = silent.bind_to_random_port("tcp://127.0.0.1")
    proc = None
    try:
        wait_healthy(url, engine, START_BOUND_S, tmp_path / "engine.log")
        run_dir = tmp_path / "run"
        proc = start_worker(run_dir, tiny_model_dir, f"tcp://127.0.0.1:{router_port}", url)
        log = run_dir / "rollout.log"
        wait_until(lambda: silent.poll(100) != 0, proc, log, "request to the broker")
        assert b"rejoin" in b"".join(silent.recv_multipart())  # the worker's first call
        assert_stops(proc, log)
    finally:
        stop_process(proc)
        stop_process(engine)
        silent.close()
