"""The driver's pure parts: layout, plan, srun lines, resume point, the USR1 handler."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from relax_slurm.checkpoint import resume_for_attempt
from relax_slurm.errors import ConfigError
from relax_slurm.launch import slurm_driver as drv
from relax_slurm.runtime.control import preempt_requested
from relax_slurm.launch.slurm_env import SlurmAllocation
from relax_slurm.launch.submit import compose_config

HET = SlurmAllocation(job_id="41", het_groups=(("t1", "t2"), ("r1", "r2")), is_het=True)
PLAIN = SlurmAllocation(job_id="42", het_groups=(("n1", "n2", "n3"),))


def cfg_for(*overrides: str):
    return compose_config(["experiment=tiny_cpu", "cluster=slurm", "run_dir=/tmp/relax-unit-run",
                           *overrides])


def test_hetjob_layout_takes_components_as_they_are():
    layout = drv.make_layout(cfg_for(), HET)
    assert layout == drv.Layout(trainer_hosts=("t1", "t2"), rollout_hosts=("r1", "r2"), het=True)
    with pytest.raises(ConfigError, match="3 het components"):
        drv.make_layout(cfg_for(), SlurmAllocation(job_id="1", het_groups=(("a",),) * 3,
                                                   is_het=True))


def test_colocated_layout_splits_or_shares_nodes():
    layout = drv.make_layout(cfg_for("cluster.layout=colocated", "cluster.trainer_nodes=2"), PLAIN)
    assert layout.trainer_hosts == ("n1", "n2") and layout.rollout_hosts == ("n3",)
    assert not layout.het
    one = SlurmAllocation(job_id="1", het_groups=(("n1",),))
    shared = drv.make_layout(cfg_for("cluster.layout=colocated", "cluster.rollout_nodes=0"), one)
    assert shared.trainer_hosts == shared.rollout_hosts == ("n1",)
    with pytest.raises(ConfigError, match="cluster.trainer_nodes=4"):
        drv.make_layout(cfg_for("cluster.layout=colocated", "cluster.trainer_nodes=4"), PLAIN)


def test_plan_addresses_roles_by_node_name():
    cfg = cfg_for("rollout.num_engines=3")
    plan = drv.slurm_plan(cfg, drv.make_layout(cfg, HET))
    assert plan.broker_router.startswith("tcp://t1:") and plan.broker_pub.startswith("tcp://t1:")
    hosts = [u.split("//")[1].split(":")[0] for u in plan.engine_urls]
    assert hosts == ["r1", "r2", "r1"]  # round robin over the rollout nodes
    assert plan.weight_sync_host == ""  # wherever trainer rank 0 lands
    assert plan.weight_sync_port > 0 and plan.trainer_master_port > 0


def _srun_lines(cfg, alloc, run_dir=Path("/runs/x")):
    layout = drv.make_layout(cfg, alloc)
    plan = drv.slurm_plan(cfg, layout)
    wrap = drv.srun_wrap(cfg, layout, "/work")
    return {s.name: wrap(s) for s in drv.role_specs(cfg, plan, layout, run_dir)}, plan


def test_srun_lines_of_a_het_job():
    lines, plan = _srun_lines(cfg_for(), HET)
    assert lines["broker"][:2] == ["srun", "--het-group=0"]
    # the broker binds the address its clients use (the node's name), never every interface
    assert "--nodelist=t1" in lines["broker"] and "0.0.0.0" not in " ".join(lines["broker"])
    assert plan.broker_router.startswith("tcp://t1:") and plan.broker_router in lines["broker"]
    assert lines["engine0"][1] == "--het-group=1" and "--nodelist=r1" in lines["engine0"]
    engine = lines["engine0"]  # the engine too: its node's name, as in the plan's URL
    assert engine[engine.index("--host") + 1] == "r1" and "0.0.0.0" not in " ".join(engine)
    assert lines["rollout"][1] == "--het-group=1"
    trainer = lines["trainer"]
    assert "--nodes=2" in trainer and "--ntasks=2" in trainer and "--ntasks-per-node=1" in trainer
    assert "--nodelist=t1,t2" in trainer
    assert "--nnodes=2" in trainer and f"--rdzv-endpoint=t1:{plan.trainer_master_port}" in trainer
    for argv in lines.values():  # concurrent steps must share the allocation
        assert "--overlap" in argv and "--kill-on-bad-exit=1" in argv


def test_opd_teacher_engine_runs_in_the_rollout_component(tmp_path):
    # the teacher of on-policy distillation is a role like the engines: the local runner starts
    # it, and so must the driver (without it every teacher request fails)
    teacher = tmp_path / "teacher"
    cfg = cfg_for("algo=opd", f"algo.teacher_model_path={teacher}", "rollout.num_engines=1")
    lines, plan = _srun_lines(cfg, HET)
    assert list(lines) == ["broker", "engine0", "teacher", "rollout", "trainer"]
    assert plan.teacher_url.startswith("http://r2:")  # next in the round robin: engine0 is on r1
    port = plan.teacher_url.rsplit(":", 1)[1]
    argv = lines["teacher"]
    assert argv[:2] == ["srun", "--het-group=1"] and "--nodelist=r2" in argv
    assert argv[argv.index("--model-path") + 1] == str(teacher)
    assert argv[argv.index("--port") + 1] == port
    assert cfg_for().algo.teacher_model_path is None
    assert "teacher" not in _srun_lines(cfg_for(), HET)[0]


def test_srun_lines_of_a_plain_job_have_no_het_group():
    lines, _ = _srun_lines(cfg_for("cluster.layout=colocated"), PLAIN)
    assert not any(a.startswith("--het-group") for argv in lines.values() for a in argv)


def test_containers_pyxis_and_prefix():
    lines, _ = _srun_lines(cfg_for("cluster.container.image=img.sqsh",
                                   "cluster.container.mounts=[/data:/data]",
                                   "cluster.container.python=python3"), HET)
    broker = lines["broker"]
    assert "--container-image=img.sqsh" in broker and "--container-mounts=/data:/data" in broker
    assert "--container-workdir=/work" in broker
    # one named container per image: pyxis imports it once per node, later steps reuse it
    names = {a for argv in lines.values() for a in argv if a.startswith("--container-name=")}
    assert len(names) == 1 and all(any(a in names for a in argv) for argv in lines.values())
    other, _ = _srun_lines(cfg_for("cluster.container.image=other.sqsh"), HET)
    assert not names & {a for a in other["broker"] if a.startswith("--container-name=")}
    cmd = broker.index("-m") - 1  # the role's command follows srun's options
    assert broker[cmd:cmd + 3] == ["python3", "-m", "relax_slurm.broker"]
    assert all(a.startswith("--") for a in broker[1:cmd])
    lines, _ = _srun_lines(cfg_for("cluster.container.prefix=[apptainer,exec,--nv,img.sif]"), HET)
    tail = lines["engine0"][lines["engine0"].index("--kill-on-bad-exit=1") + 1:]
    assert tail[:5] == ["apptainer", "exec", "--nv", "img.sif", "python"]


def test_sglang_engines_run_the_containers_python(monkeypatch):
    # the engine's command is `bash -c 'exec PYTHON -m sglang.launch_server ... --api-key "$K"'`
    # (the key stays off the command line): the launcher's interpreter inside that script meant
    # the host's python inside the image
    import sys as _sys

    monkeypatch.setenv("RELAX_ENGINE_API_KEY", "k")
    lines, _ = _srun_lines(cfg_for("rollout=sglang", "cluster.container.image=img.sqsh",
                                   "cluster.container.python=/opt/py/bin/python3"), HET)
    engine = lines["engine0"]
    script = " ".join(engine[engine.index("--kill-on-bad-exit=1") + 1:])
    assert "/opt/py/bin/python3 -m sglang.launch_server" in script, script
    assert _sys.executable not in script
    assert all(_sys.executable not in " ".join(argv) for argv in lines.values())


def test_extra_srun_args_come_before_the_command():
    lines, _ = _srun_lines(cfg_for("cluster.extra_srun_args=['--mpi=none']"), HET)
    argv = lines["trainer"]
    assert argv.index("--mpi=none") < argv.index("-m")


def _fake_checkpoint(run_dir: Path, step: int) -> Path:
    d = run_dir / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("x")
    (d / "meta.json").write_text(json.dumps({"step": step}))
    return d


def resume_point(cfg, run_dir, attempt):
    """The rule the driver applies to each attempt (shared with local global restarts)."""
    return resume_for_attempt(run_dir, cfg.resume, cfg.overwrite, attempt)


def test_resume_point_first_attempt_follows_config(tmp_path):
    assert resume_point(cfg_for(), tmp_path, attempt=0) is None
    ckpt = _fake_checkpoint(tmp_path, 5)
    assert resume_point(cfg_for(), tmp_path, attempt=0) == ckpt
    with pytest.raises(ConfigError, match="resume=none"):
        resume_point(cfg_for("resume=none"), tmp_path, attempt=0)


def test_requeued_attempt_always_continues_its_own_run(tmp_path):
    ckpt = _fake_checkpoint(tmp_path, 7)
    cfg = cfg_for("resume=none", "overwrite=true")
    assert resume_point(cfg, tmp_path, attempt=1) == ckpt  # not cleared by overwrite=true
    assert ckpt.is_dir()
    assert resume_point(cfg, tmp_path, attempt=0) is None  # first attempt: starts over
    assert not ckpt.exists()


def test_usr1_requests_preemption_and_arms_the_fallback(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(drv, "requeue", calls.append)
    handler = drv.PreemptSignal(tmp_path, HET, cfg_for("cluster.preempt_timeout_s=0.05"))
    handler(signal.SIGUSR1, None)
    assert preempt_requested(tmp_path)
    handler.timer.join(timeout=5)
    assert calls == ["41"]  # the trainer did not stop in time: requeued anyway


def test_usr1_fallback_is_cancelled_when_the_trainer_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(drv, "requeue", lambda job: pytest.fail("requeued"))
    handler = drv.PreemptSignal(tmp_path, HET, cfg_for("cluster.preempt_timeout_s=30"))
    handler(signal.SIGUSR1, None)
    handler.cancel()
    assert not handler.timer.is_alive() or handler.timer.finished.is_set()


def test_requeue_failure_says_how_to_resume(monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 1, "", "Requested operation is presently disabled"))
    with pytest.raises(drv.RoleFailed, match="same run_dir to resume"):
        drv.requeue("41")


def test_sigterm_of_our_own_requeue_does_not_read_as_terminated(tmp_path, monkeypatch):
    import os

    from relax_slurm.config import save_config
    from relax_slurm.errors import Preempted
    from relax_slurm.runtime.control import read_status

    cfg = cfg_for(f"run_dir={tmp_path}")
    save_config(cfg, tmp_path / "config.yaml")

    def preempted(*args, **kwargs):
        raise Preempted("trainer stopped on a preemption request")

    def requeue(job_id):  # what slurmctld does on `scontrol requeue`: SIGTERM to the batch step
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(drv, "supervise", preempted)
    monkeypatch.setattr(drv, "requeue", requeue)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with pytest.raises(Preempted):  # not KeyboardInterrupt ("terminated", exit 143)
            drv.drive(tmp_path, HET)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert read_status(tmp_path)["state"] == "requeued"


def test_sft_runs_the_trainer_alone_locally_and_on_slurm(tmp_path):
    from relax_slurm.launch.local import local_plan
    from relax_slurm.launch.roles import run_specs

    cfg = compose_config(["experiment=tiny_sft_cpu", f"run_dir={tmp_path}"])
    plan = local_plan(cfg)
    assert plan.engine_urls == [] and plan.broker_admin is None  # nothing to watch but it
    specs = run_specs(cfg, plan, tmp_path, "127.0.0.1", ["127.0.0.1"])
    assert [s.name for s in specs] == ["trainer"]
    layout = drv.make_layout(cfg, PLAIN)
    assert [s.name for s in drv.role_specs(cfg, drv.slurm_plan(cfg, layout), layout, tmp_path)
            ] == ["trainer"]


def test_managed_judge_runs_in_the_rollout_component_after_the_teacher(tmp_path):
    # reward.genrm_model_path makes the judge a role like the teacher: next in the round robin,
    # restarted in place, outside the weight sync, never reporting routed experts
    judge = tmp_path / "judge"
    cfg = cfg_for("reward.name=genrm", f"reward.genrm_model_path={judge}", "rollout.num_engines=1",
                  "rollout.return_routed_experts=true")
    lines, plan = _srun_lines(cfg, HET)
    assert list(lines) == ["broker", "engine0", "genrm", "rollout", "trainer"]
    assert plan.genrm_url.startswith("http://r2:") and plan.teacher_url is None
    argv = lines["genrm"]
    assert argv[:2] == ["srun", "--het-group=1"] and "--nodelist=r2" in argv
    assert argv[argv.index("--model-path") + 1] == str(judge)
    assert argv[argv.index("--port") + 1] == plan.genrm_url.rsplit(":", 1)[1]
    assert "--enable-return-routed-experts" not in argv
    spec = next(s for s in drv.role_specs(cfg, plan, drv.make_layout(cfg, HET), Path("/r"))
                if s.name == "genrm")
    assert spec.restart_argv == spec.argv and spec.health_url == plan.genrm_url
    assert plan.genrm_url not in plan.engine_urls  # the weight sync pushes to engine_urls only
    teacher = cfg_for("algo=opd", f"algo.teacher_model_path={tmp_path}", "reward.name=genrm",
                      f"reward.genrm_model_path={judge}", "rollout.num_engines=1")
    lines, plan = _srun_lines(teacher, HET)
    assert list(lines) == ["broker", "engine0", "teacher", "genrm", "rollout", "trainer"]
    assert plan.teacher_url.startswith("http://r2:") and plan.genrm_url.startswith("http://r1:")
    assert "genrm" not in _srun_lines(cfg_for("reward.name=genrm", "reward.genrm_url=http://j:1"),
                                      HET)[0]


def test_roles_without_gpus_ask_slurm_for_none():
    # srun(1): a step gets every GPU of the job on its nodes unless it sets --gres; before
    # 22.05 --overlap shared CPUs only, so a broker step on the trainer node took its GPUs
    lines, _ = _srun_lines(cfg_for("rollout.num_engines=2"), HET)
    for name in ("broker", "rollout", "engine0", "engine1"):  # hf engines run on the CPU
        assert "--gpus-per-node=0" in lines[name], name
    assert "--gpus-per-node=0" not in lines["trainer"]
    lines, _ = _srun_lines(cfg_for("rollout=sglang", "rollout.num_engines=2"), HET)
    assert "--gpus-per-node=0" not in lines["engine0"] and "--gpus-per-node=0" not in lines["trainer"]
    assert "--gpus-per-node=0" in lines["broker"] and "--gpus-per-node=0" in lines["rollout"]


def test_two_gpu_steps_on_a_node_need_slurm_22_05():
    cfg = cfg_for("rollout=sglang", "rollout.num_engines=3")  # r1 runs engine0 and engine2
    layout = drv.make_layout(cfg, HET)
    specs = drv.role_specs(cfg, drv.slurm_plan(cfg, layout), layout, Path("/runs/x"))
    with pytest.raises(ConfigError, match=r"Slurm 21\.08 .* node r1 would run \['engine0', "
                                          r"'engine2'\].*Slurm >= 22\.05"):
        drv.check_gpu_steps(cfg, specs, layout, (21, 8))
    drv.check_gpu_steps(cfg, specs, layout, (22, 5))
    drv.check_gpu_steps(cfg, specs, layout, None)  # unknown: nothing to refuse on
    # one GPU role per node is fine on any release; hf engines hold no GPU
    two = cfg_for("rollout=sglang", "rollout.num_engines=2")
    drv.check_gpu_steps(two, drv.role_specs(two, drv.slurm_plan(two, layout), layout,
                                            Path("/runs/x")), layout, (20, 11))
    hf = cfg_for("rollout.num_engines=3")
    drv.check_gpu_steps(hf, drv.role_specs(hf, drv.slurm_plan(hf, layout), layout,
                                           Path("/runs/x")), layout, (20, 11))


@pytest.mark.parametrize("text, version", [
    ("slurm 22.05.8\n", (22, 5)), ("slurm-wlm 23.11.4", (23, 11)), ("slurm 21.08.8-2", (21, 8)),
    ("", None), ("srun: command not found", None)])
def test_the_slurm_release_is_read_from_srun_version(text, version):
    assert drv.slurm_version(text) == version
