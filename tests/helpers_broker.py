"""A real broker process for tests: `start_broker` (a fixture in tests/unit/conftest.py) starts
brokers as relax-train does; `group` makes a small group of samples."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from relax_slurm.auth import SECRET_ENV
from relax_slurm.broker import BrokerClient
from relax_slurm.config import save_config
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.broker import BrokerConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.samples import Group, Sample

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 5.0  # client timeout while the broker is alive; generous on a loaded machine


@dataclass
class Broker:
    proc: subprocess.Popen[bytes]
    router: str
    pub: str
    log: Path
    admin: str | None = None
    """http://HOST:PORT of the admin HTTP, when started with it."""

    def client(self, identity: str | None = None, timeout_s: float = TIMEOUT_S) -> BrokerClient:
        return BrokerClient(self.router, timeout_s, identity)


def group(gid: int, version: int = 0, n: int = 2) -> Group:
    return [Sample(prompt_id=f"p{gid}", group_id=gid, prompt_ids=np.arange(3),
                   response_ids=np.arange(i + 1), loss_mask=np.ones(i + 1),
                   rollout_logprobs=-np.ones(i + 1), reward=float(i), version=version,
                   version_min=version) for i in range(n)]


SECRET = "test-run-secret"


def broker_starter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                   ) -> Iterator[Callable[..., Broker]]:
    """Start brokers as relax-train does, with the run's secret in the environment (which the
    clients in this process read too)."""
    started: list[subprocess.Popen[bytes]] = []
    monkeypatch.setenv(SECRET_ENV, SECRET)

    def start(max_staleness: int = 0, batch_size: int = 1, max_message_mb: int = 1024,
              admin: bool = False, router: str = "tcp://127.0.0.1:*",
              pub: str = "tcp://127.0.0.1:*", extra_args: tuple[str, ...] = ()) -> Broker:
        cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="x"),
                          data=DataConfig(train_files=["x"]),
                          algo=AlgoConfig(max_staleness=max_staleness),
                          rollout=RolloutConfig(batch_size=batch_size),
                          broker=BrokerConfig(max_message_mb=max_message_mb))
        save_config(cfg, tmp_path / "config.yaml")
        log = tmp_path / f"broker{len(started)}.log"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
        with open(log, "wb") as out:
            # port `*`: the OS picks free ports and the broker prints what it bound
            proc = subprocess.Popen(
                [sys.executable, "-m", "relax_slurm.broker", "--config",
                 str(tmp_path / "config.yaml"), "--router", router, "--pub", pub,
                 *(["--admin", "127.0.0.1:0"] if admin else []), *extra_args],
                cwd=REPO, env=env, stdout=out,
                stderr=subprocess.STDOUT)
        started.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = re.search(r"router=(\S+) pub=(\S+)(?: admin=(\S+))?", log.read_text())
            if m:
                return Broker(proc, m[1], m[2], log, m[3])
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"broker did not start:\n{log.read_text()}")

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
