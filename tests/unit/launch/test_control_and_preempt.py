"""Preemption requests, the driver's status file, and how the supervisor reads a trainer exit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relax_slurm.config import TrainConfig
from relax_slurm.config.cluster import ContainerConfig, SlurmClusterConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.errors import ConfigError, Preempted, RelaxError, RoleFailed
from relax_slurm.runtime import control
from relax_slurm.launch.processes import ProcessSet
from relax_slurm.launch.supervisor import watch


def test_request_clear_and_status(tmp_path):
    assert not control.preempt_requested(tmp_path)
    path = control.request_preempt(tmp_path, reason="SIGUSR1")
    assert path == tmp_path / "control" / "preempt" and "SIGUSR1" in path.read_text()
    assert control.preempt_requested(tmp_path)
    control.request_preempt(tmp_path)  # idempotent
    control.clear_preempt(tmp_path)
    control.clear_preempt(tmp_path)
    assert not control.preempt_requested(tmp_path)
    assert control.read_status(tmp_path) is None
    control.write_status(tmp_path, "requeued", job_id="9", attempt=0, message="m")
    status = control.read_status(tmp_path)
    assert status["state"] == "requeued" and status["job_id"] == "9"
    assert issubclass(Preempted, RelaxError)


def _watch_exit(tmp_path: Path, code: int, request: bool):
    cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="m"),
                      data=DataConfig(train_files=["d"]))
    cfg.metrics.progress = False
    if request:
        control.request_preempt(tmp_path)
    (tmp_path / "logs").mkdir(exist_ok=True)
    procs = ProcessSet(tmp_path / "logs", env={})
    try:
        trainer = procs.start("trainer", [sys.executable, "-c", f"raise SystemExit({code})"])
        trainer.proc.wait(timeout=60)
        watch(procs, trainer, cfg, tmp_path)
    finally:
        procs.close()


def test_trainer_exit_75_is_a_preemption(tmp_path):
    with pytest.raises(Preempted, match="preemption request"):
        _watch_exit(tmp_path, control.PREEMPT_EXIT_CODE, request=False)


def test_torchrun_exit_after_a_request_is_a_preemption(tmp_path):
    # torchrun reports a rank's 75 as its own generic 1
    with pytest.raises(Preempted):
        _watch_exit(tmp_path, 1, request=True)


def test_other_exits_are_failures(tmp_path):
    with pytest.raises(RoleFailed, match="exited with code 1"):
        _watch_exit(tmp_path, 1, request=False)
    _watch_exit(tmp_path, 0, request=True)  # finished anyway: a normal end


@pytest.mark.parametrize("kwargs,key", [
    (dict(layout="split"), "cluster.layout"),
    (dict(layout="hetjob", rollout_nodes=0), "cluster.rollout_nodes"),
    (dict(trainer_nodes=0), "cluster.trainer_nodes"),
    (dict(time_limit_min=1, signal_lead_s=120), "cluster.signal_lead_s"),
    (dict(signal_lead_s=60, preempt_timeout_s=90), "cluster.preempt_timeout_s"),
    (dict(extra_sbatch_args=["-C", "a100"]), "cluster.extra_sbatch_args"),
    (dict(cpus_per_task=0), "cluster.cpus_per_task"),
])
def test_cluster_config_checks_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        SlurmClusterConfig(**kwargs)


def test_container_checks_name_the_key():
    with pytest.raises(ConfigError, match=r"cluster\.container\.image \(pyxis\)"):
        ContainerConfig(image="a", prefix=["apptainer"])
    with pytest.raises(ConfigError, match=r"cluster\.container\.mounts"):
        ContainerConfig(mounts=["/data:/data"], prefix=["apptainer"])


def test_colocated_may_share_nodes():
    assert SlurmClusterConfig(layout="colocated", rollout_nodes=0).rollout_nodes == 0
    no_signal = SlurmClusterConfig(signal_lead_s=0, preempt_timeout_s=1000)
    assert no_signal.signal_lead_s == 0
