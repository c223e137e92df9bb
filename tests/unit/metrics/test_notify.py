"""Apprise notifications, delivered to a json:// receiver on a free local port."""

from __future__ import annotations

import logging
import sys

import pytest

from relax_slurm.config.reporting import NotifyConfig
from relax_slurm.metrics.notify import Notifier, step_message
from tests.json_receiver import json_receiver


@pytest.fixture
def receiver():
    with json_receiver() as r:
        yield r


def test_start_steps_and_end_reach_a_local_json_receiver(receiver):
    pytest.importorskip("apprise")
    url, got = receiver
    n = Notifier(NotifyConfig(urls=[url], every_steps=2), "demo")
    assert n.active
    n.send("started", "4 steps")
    for step in range(4):
        n.on_row({"step": step, "rollout/reward_mean": 0.1 * step}, 4)
    n.send("crashed", "role 'engine0' exited\n" + "x" * 10_000)
    titles = [m["title"] for m in got]
    assert titles == ["[relax] demo: started", "[relax] demo: step 2/4", "[relax] demo: step 4/4",
                      "[relax] demo: crashed"]
    assert got[2]["message"] == "rollout/reward_mean = 0.3 (+0.2)"
    assert got[3]["message"].endswith("x" * 100) and len(got[3]["message"]) < 3100


def test_without_apprise_a_warning_not_a_crash(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "apprise", None)  # makes `import apprise` raise ImportError
    with caplog.at_level(logging.WARNING, logger="relax_slurm.notify"):
        n = Notifier(NotifyConfig(urls=["json://127.0.0.1:9/x"], every_steps=1), "demo")
    assert "pip install apprise" in caplog.text
    assert not n.active
    n.send("started", "nothing happens")
    n.on_row({"step": 0}, 1)


def test_step_message_shows_deltas_only_when_there_is_a_previous_value():
    assert step_message({"rollout/reward_mean": 0.5, "train/entropy": 1.0},
                        {"rollout/reward_mean": 0.25}) == (
        "rollout/reward_mean = 0.5 (+0.25)\ntrain/entropy = 1")
