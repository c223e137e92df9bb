"""The supervisor's notifications: start, then crash naming the failing role with its log tail."""

from __future__ import annotations

import sys

import pytest

from relax_slurm.config import TrainConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.reporting import NotifyConfig
from relax_slurm.errors import RoleFailed
from relax_slurm.launch.roles import RoleSpec
from relax_slurm.launch.supervisor import supervise
from tests.json_receiver import json_receiver


def test_a_dying_role_sends_started_then_crashed_with_its_log_tail(tmp_path):
    pytest.importorskip("apprise")
    crash = "print('loading shard 3'); print('boom: out of memory', flush=True); raise SystemExit(3)"
    specs = [RoleSpec(name="trainer", argv=[sys.executable, "-c", crash], het_group=0,
                      host="127.0.0.1")]
    (tmp_path / "logs").mkdir()  # made by the launcher before supervise
    with json_receiver() as (url, got):
        cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="m"),
                          data=DataConfig(train_files=["d"]), notify=NotifyConfig(urls=[url]))
        cfg.metrics.progress = False
        with pytest.raises(RoleFailed, match="role 'trainer'"):
            supervise(specs, cfg, tmp_path, wrap=lambda spec: spec.argv)
    assert [m["title"].split(": ", 1)[1] for m in got] == ["started", "crashed"]
    assert "role 'trainer' exited with code 3" in got[1]["message"]
    assert "boom: out of memory" in got[1]["message"]
