"""Heartbeat pacing and its config check."""

from __future__ import annotations

import pytest

from relax_slurm.broker.heartbeat import Pacer
from relax_slurm.config.cluster import RestartConfig
from relax_slurm.errors import ConfigError


def test_pacer_is_due_at_once_then_once_per_interval() -> None:
    now = [100.0]
    pacer = Pacer(10.0, clock=lambda: now[0])
    assert pacer.due() and not pacer.due()
    now[0] = 109.9
    assert not pacer.due()
    now[0] = 110.0
    assert pacer.due() and not pacer.due()


def test_timeout_must_leave_room_for_two_beats() -> None:
    RestartConfig(heartbeat_interval_s=5, heartbeat_timeout_s=10)
    RestartConfig(heartbeat_interval_s=5, heartbeat_timeout_s=0)  # off
    with pytest.raises(ConfigError, match="cluster.restart.heartbeat_timeout_s=9"):
        RestartConfig(heartbeat_interval_s=5, heartbeat_timeout_s=9)
