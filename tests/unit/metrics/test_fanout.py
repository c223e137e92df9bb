"""Metrics fan-out: jsonl + TensorBoard + wandb (offline) from one call, and what fails how."""

from __future__ import annotations

import builtins
import json
import time

import pytest

from relax_slurm.config.reporting import MetricsConfig, WandbConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.errors import ConfigError
from relax_slurm.metrics.fanout import check_installed, open_sinks
from relax_slurm.metrics.wandb_run import ID_FILE, run_id, wandb_mode
from tests.unit.metrics.wandb_records import config_keys, history_keys

ROWS = [{"rollout/reward_mean": 0.1 * i, "train/loss": 1.0 - i, "perf/step_time_s": 2.0,
         "train/kl": None} for i in range(3)]


def tb_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_one_log_call_reaches_jsonl_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrainConfig(run_dir=str(tmp_path), metrics=MetricsConfig(
        tensorboard=True, wandb=WandbConfig(enabled=True, project="p", tags=["unit"])))
    sinks = open_sinks(cfg, tmp_path)
    for step, row in enumerate(ROWS):
        sinks.log(step, row)
    sinks.close()

    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]

    scalars = tb_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(0, 1.0), (1, 0.0), (2, -1.0)]
    assert "train/kl" not in scalars  # None is "not measured", not a point at 0

    wandb_id = (tmp_path / ID_FILE).read_text().strip()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{wandb_id}/run-{wandb_id}.wandb"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    # wandb-core (a process of its own) writes the file; once, in a full suite on a loaded
    # machine, the history read empty right after finish() (alone the test passed): give the
    # file a bounded time to get there
    want = {"rollout/reward_mean", "train/loss", "perf/step_time_s"}
    deadline = time.monotonic() + 30
    while not want <= history_keys(runs[0]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert want <= history_keys(runs[0])
    assert {"algo", "rollout", "trainer", "metrics"} <= config_keys(runs[0])


def test_a_resumed_run_reuses_the_stored_wandb_id(tmp_path):
    assert run_id(tmp_path, "first") == "first"
    assert run_id(tmp_path, "second") == "first"


def test_wandb_mode_is_offline_without_an_api_key():
    auto = WandbConfig(enabled=True)
    assert wandb_mode(auto, {}) == "offline"
    assert wandb_mode(auto, {"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode(WandbConfig(mode="offline"), {"WANDB_API_KEY": "k"}) == "offline"
    with pytest.raises(ConfigError, match="metrics.wandb.mode"):
        WandbConfig(mode="cloud")


def test_a_missing_optional_package_names_the_key_and_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    cfg = TrainConfig(run_dir=str(tmp_path), metrics=MetricsConfig(tensorboard=True))
    with pytest.raises(ConfigError, match=r"metrics.tensorboard=true.*pip install tensorboard"):
        check_installed(cfg)

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    monkeypatch.delitem(__import__("sys").modules, "wandb", raising=False)
    cfg = TrainConfig(run_dir=str(tmp_path), metrics=MetricsConfig(wandb=WandbConfig(enabled=True)))
    with pytest.raises(ConfigError, match=r"metrics.wandb.enabled=true.*pip install wandb"):
        open_sinks(cfg, tmp_path)
