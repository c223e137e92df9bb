"""Preemption and stop requests, the driver's status file, and how the supervisor reads a
trainer exit and a run that ended early."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from relax_slurm.auth import ensure_secret
from relax_slurm.config import TrainConfig
from relax_slurm.config.cluster import ContainerConfig, SlurmClusterConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.errors import ConfigError, Preempted, RelaxError, RoleFailed
from relax_slurm.runtime import control
from relax_slurm.launch.local import local_plan, prepare_run_dir
from relax_slurm.launch.processes import ProcessSet
from relax_slurm.launch.supervisor import run_summary, watch
from tests.unit.launch.test_rerun import fake_checkpoint


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


def test_a_trainer_that_answered_the_request_names_its_checkpoint(tmp_path):
    _short_run(tmp_path, 8, 40)  # metrics.jsonl: steps 0..7 logged
    ckpt = fake_checkpoint(tmp_path, 8)
    with pytest.raises(Preempted) as e:
        _watch_exit(tmp_path, 1, request=True)
    assert str(e.value) == (f"trainer stopped on a preemption request after 8 steps, "
                            f"checkpointed (exit code 1); it resumes from {ckpt} when the run "
                            "is started again")


def test_a_trainer_that_died_before_its_checkpoint_is_not_said_to_have_answered(tmp_path):
    """CI's red run of 36f0992: a rank killed by SIGSEGV while a preemption request was on
    file was reported as having stopped on the request; the job is requeued all the same (it
    was being preempted), but the message says the trainer died, what it logged, and which
    steps the next attempt trains again."""
    _short_run(tmp_path, 8, 40)  # metrics.jsonl: steps 0..7 logged
    ckpt = fake_checkpoint(tmp_path, 5)
    with pytest.raises(Preempted) as e:
        _watch_exit(tmp_path, 1, request=True)
    message = str(e.value)
    assert message.startswith(
        "role 'trainer' exited with code 1 while a preemption request was pending, before it "
        f"saved the checkpoint of its last logged step 8: it resumes from {ckpt} when the run "
        "is started again, training steps 5-7 again; its log is "), message
    assert "Last lines:" in message


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


def test_stop_request_read_and_clear(tmp_path):
    assert control.read_stop(tmp_path) is None and control.pending_request(tmp_path) is None
    path = control.request_stop(tmp_path, reason="plateau")
    assert path == tmp_path / "control" / "stop" and not list(path.parent.glob(".stop*"))
    assert control.stop_requested(tmp_path) and control.read_stop(tmp_path)["reason"] == "plateau"
    assert control.pending_request(tmp_path) == control.STOP
    control.request_preempt(tmp_path)
    assert control.pending_request(tmp_path) == control.STOP  # a stop outranks a preemption
    control.request_stop(tmp_path, reason="again")  # idempotent; the last reason is kept
    assert control.read_stop(tmp_path)["reason"] == "again"
    control.clear_stop(tmp_path)
    control.clear_stop(tmp_path)
    assert not control.stop_requested(tmp_path)
    assert control.pending_request(tmp_path) == control.PREEMPT
    path.write_text("reward plateaued\n")  # written by hand: still a request, its text the reason
    assert control.read_stop(tmp_path) == {"reason": "reward plateaued"}


def _short_run(tmp_path: Path, reached: int, total: int) -> TrainConfig:
    """A run dir whose metrics.jsonl logged steps 0..reached-1 of `total`."""
    cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="m"),
                      data=DataConfig(train_files=["d"]))
    cfg.trainer.total_steps = total
    rows = [{"step": s, "rollout/reward_mean": 0.5, "train/samples": 4} for s in range(reached)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cfg


def test_summary_accepts_a_requested_stop(tmp_path):
    cfg = _short_run(tmp_path, reached=7, total=1000)
    control.request_stop(tmp_path, reason="plateau")
    summary = run_summary(tmp_path, cfg, 1.0, None, {}, None)
    assert summary["steps"] == 7
    assert summary["stopped_early"] == {"at_step": 7, "total_steps": 1000, "reason": "plateau"}
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_summary_without_a_stop_request_fails_a_short_run(tmp_path):
    cfg = _short_run(tmp_path, reached=7, total=1000)
    control.request_preempt(tmp_path)  # not a stop: a run cut short by it is not finished
    with pytest.raises(RoleFailed, match="after step 7 of 1000"):
        run_summary(tmp_path, cfg, 1.0, None, {}, None)
    assert "stopped_early" not in json.loads((tmp_path / "summary.json").read_text())


def test_summary_of_a_complete_run_has_no_stop_record(tmp_path):
    cfg = _short_run(tmp_path, reached=5, total=5)
    control.request_stop(tmp_path)  # asked for after the last step: the run simply completed
    assert "stopped_early" not in run_summary(tmp_path, cfg, 1.0, None, {}, None)


def _ctl(capsys, *argv: str) -> tuple[int, str, str]:
    from relax_slurm.launch.ctl import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_relax_ctl_stop(tmp_path, capsys):
    rc, _, err = _ctl(capsys, "stop", str(tmp_path))
    assert rc == 1 and f"{tmp_path} is not a run directory" in err and "run_dir" in err
    assert not control.stop_requested(tmp_path)
    (tmp_path / "config.yaml").write_text("{}\n")
    rc, _, err = _ctl(capsys, "stop", str(tmp_path))  # a Slurm job still queued
    assert rc == 1 and "has not started its roles (no plan.json)" in err and "scancel" in err
    (tmp_path / "plan.json").write_text("{}\n")
    rc, out, _ = _ctl(capsys, "stop", str(tmp_path), "--reason", "plateau")
    assert rc == 0 and json.loads(out)["requested"] == "stop"
    assert control.read_stop(tmp_path)["reason"] == "plateau"
    # --wait: until summary.json is written (here by a thread, as the launcher would, once
    # the request is on file: request_stop replaces the file, so its inode changes)
    summary = {"steps": 3, "stopped_early": {"at_step": 3, "reason": "plateau"}}
    stop_file, asked = tmp_path / "control" / "stop", (tmp_path / "control" / "stop").stat()

    def end_the_run() -> None:
        deadline = time.monotonic() + 30
        while stop_file.stat().st_ino == asked.st_ino and time.monotonic() < deadline:
            time.sleep(0.01)
        # whole, as the launcher writes it (metrics/summary.py): --wait reads it on sight
        (tmp_path / "summary.json.tmp").write_text(json.dumps(summary))
        os.replace(tmp_path / "summary.json.tmp", tmp_path / "summary.json")

    writer = threading.Thread(target=end_the_run)
    writer.start()
    try:
        rc, out, _ = _ctl(capsys, "stop", str(tmp_path), "--wait", "--wait-s", "30")
    finally:
        writer.join()
    assert rc == 0 and json.loads(out) == summary
    rc, _, err = _ctl(capsys, "stop", str(tmp_path))  # ended: summary.json after plan.json
    assert rc == 1 and "has ended already" in err
    (tmp_path / "summary.json").unlink()
    rc, _, err = _ctl(capsys, "stop", str(tmp_path), "--wait", "--wait-s", "0.5")
    assert rc == 1 and "not written within 0.5s" in err


def test_relax_ctl_on_a_run_that_has_ended_says_so(tmp_path, capsys):
    """Its broker is gone: `relax-ctl status` said only "connection refused; is the run still
    going?" where summary.json already answers."""
    cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="m"),
                      data=DataConfig(train_files=["d"]))
    prepare_run_dir(cfg, local_plan(cfg), attempt=0)  # config.yaml and plan.json, no broker
    ensure_secret(tmp_path)
    rc, _, err = _ctl(capsys, "status", str(tmp_path))
    assert rc == 1 and "is the run still going?" in err, err  # started, and nothing answers
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3}))
    for command in ("status", "engines"):
        rc, _, err = _ctl(capsys, command, str(tmp_path))
        assert rc == 1 and f"the run in {tmp_path} has ended already" in err, err


def test_a_new_run_clears_a_stale_stop_and_a_global_restart_keeps_one(tmp_path):
    cfg = TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path="m"),
                      data=DataConfig(train_files=["d"]))
    control.request_stop(tmp_path)  # asked for before the failure that restarts the run
    prepare_run_dir(cfg, local_plan(cfg), attempt=1)
    assert control.stop_requested(tmp_path)
    prepare_run_dir(cfg, local_plan(cfg), attempt=0)  # started again: a new run
    assert not control.stop_requested(tmp_path)


def test_the_summary_says_where_a_reward_target_was_reached_stopped_there_or_not(tmp_path):
    # trainer.stop_at reached at the bound's last step: nothing is left to stop (no
    # stopped_early), and summary.json still says the target was reached, and where
    cfg = _short_run(tmp_path, reached=5, total=5)
    rows = [{"step": s, "rollout/reward_mean": r, "train/samples": 4}
            for s, r in enumerate((0.0, 0.25, 0.5, 0.75, 1.0))]  # exact in binary
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.trainer.stop_at.reward, cfg.trainer.stop_at.steps = 0.75, 3
    control.request_stop(tmp_path, reason="trainer.stop_at.reward=0.75 reached at step 5")
    summary = run_summary(tmp_path, cfg, 1.0, None, {}, None)
    assert "stopped_early" not in summary
    assert summary["stop_at"] == {"reward": 0.75, "steps": 3, "reached_at_step": 5}
    cfg.trainer.stop_at.reward = 0.9  # never reached: said so
    assert run_summary(tmp_path, cfg, 1.0, None, {}, None)["stop_at"]["reached_at_step"] is None
    # a run resumed from another run's checkpoint logs only its own steps (here 10-14): the
    # step is the run's, not the row's index
    rows = [dict(r, step=r["step"] + 10) for r in rows]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.trainer.total_steps, cfg.trainer.stop_at.reward = 15, 0.5
    assert run_summary(tmp_path, cfg, 1.0, None, {}, None)["stop_at"]["reached_at_step"] == 14
    cfg.trainer.stop_at.reward = None  # no target, no record
    assert "stop_at" not in run_summary(tmp_path, cfg, 1.0, None, {}, None)
