"""The local runner (cluster=local): every role a subprocess of this one on this machine.

Roles: broker, engines, the teacher engine and the judge engine (`genrm`) if any, rollout
worker, torchrun trainer, all started at once (the worker and trainer wait for the engines'
/health). The run ends when the trainer exits 0; any other exit, or no new step for
`cluster.restart.step_timeout_s`, fails it naming the role and its log. Every child is
stopped in `finally`, Ctrl-C included.

With `cluster.restart.max_global > 0` a failed attempt is followed by a global restart: every
role anew (fresh ports), the trainer from the latest checkpoint in the run directory, the
broker at that version. Each restart is recorded in RUN_DIR/restarts.jsonl and counted in
summary.json (`global_restarts`).
"""

from __future__ import annotations

import time
from pathlib import Path

from relax_slurm.auth import logs_dir
from relax_slurm.checkpoint import resume_for_attempt
from relax_slurm.config import TrainConfig, save_config
from relax_slurm.errors import RoleFailed
from relax_slurm.launch.inputs import (check_inputs, prepare_sglang_engines,
                                       record_global_restart, say)
from relax_slurm.launch.interrupt import STOP
from relax_slurm.runtime.lifetime import adopt_orphans
from relax_slurm.launch.rerun import plan_rerun
from relax_slurm.launch.roles import child_env, role_imports, run_specs
from relax_slurm.launch.supervisor import supervise
from relax_slurm.runtime.zygote import Zygote, use_zygote
from relax_slurm.runtime.control import clear_preempt, clear_stop
from relax_slurm.runtime.plan import RunPlan, save_plan
from relax_slurm.runtime.ports import free_port

LOCALHOST = "127.0.0.1"


def local_plan(cfg: TrainConfig) -> RunPlan:
    if cfg.supervised:  # the trainer alone: its rendezvous port is the whole plan
        return RunPlan(broker_router="", broker_pub="", trainer_master_port=free_port())
    host = cfg.broker.host
    return RunPlan(
        broker_router=f"tcp://{host}:{free_port(host)}",
        broker_pub=f"tcp://{host}:{free_port(host)}",
        broker_admin=f"http://{host}:{free_port(host)}",
        engine_urls=[f"http://{LOCALHOST}:{free_port()}" for _ in range(cfg.rollout.num_engines)],
        teacher_url=(f"http://{LOCALHOST}:{free_port()}" if cfg.algo.teacher_model_path
                     else None),
        genrm_url=(f"http://{LOCALHOST}:{free_port()}" if cfg.reward.genrm_model_path
                   else None),
        proxy_url=(f"http://{LOCALHOST}:{cfg.rollout.proxy_port or free_port()}"
                   if cfg.rollout.agent_mode == "proxy" else None),
        weight_sync_host=LOCALHOST,
        weight_sync_port=free_port(),
        trainer_master_port=free_port(),
    )


def prepare_run_dir(cfg: TrainConfig, plan: RunPlan, attempt: int = 0) -> Path:
    """Resolve what to resume from (once, for every role), then write config and plan.

    A restarted attempt (attempt > 0) continues from its latest checkpoint."""
    run_dir = Path(cfg.run_dir).resolve()
    resume = resume_for_attempt(run_dir, cfg.resume, cfg.overwrite, attempt)
    plan.resume_from = str(resume) if resume else None
    clear_preempt(run_dir)  # a Ctrl-C that stopped the run before must not stop this one
    if attempt == 0:  # nor a `relax-ctl stop` that ended it; a global restart keeps one
        clear_stop(run_dir)  # asked for before its failure: the restarted attempt stops
    logs_dir(run_dir)
    save_config(cfg, run_dir / "config.yaml")
    save_plan(plan, run_dir)
    return run_dir


def run_attempt(cfg: TrainConfig, attempt: int, started: float,
                zygote: Zygote | None = None) -> dict:
    plan = local_plan(cfg)  # fresh ports: the last attempt's may not be free yet
    run_dir = prepare_run_dir(cfg, plan, attempt)
    specs = run_specs(cfg, plan, run_dir, LOCALHOST, [LOCALHOST])
    return supervise(specs, cfg, run_dir, wrap=lambda spec: spec.argv, started=started,
                     extra={"global_restarts": attempt}, zygote=zygote)


def start_zygote(cfg: TrainConfig) -> Zygote | None:
    """The zygote that forks this run's roles (runtime/zygote.py), started first so that its
    imports overlap the checks below; None where it may not fork (see `use_zygote`)."""
    # a dead role's orphans come here, to be stopped (launch/processes.py), and so do the
    # zygote's roles, to be waited for
    adopted = adopt_orphans()
    if not (adopted and use_zygote(cfg.cluster.fork_roles)):
        return None
    return Zygote.start(role_imports(cfg), child_env(cfg, secret=""))


def run_local(cfg: TrainConfig) -> dict | None:
    """Run to the end, restarting globally after a failure up to cluster.restart.max_global;
    returns the summary, None for a run already complete (nothing started, summary.json
    kept). Raises RoleFailed/ConfigError with the cause."""
    zygote = start_zygote(cfg)
    try:
        return _run_attempts(cfg, zygote)
    finally:
        if zygote is not None:
            zygote.close()


def _run_attempts(cfg: TrainConfig, zygote: Zygote | None) -> dict | None:
    prepare_sglang_engines(cfg)
    check_inputs(cfg)
    rerun = plan_rerun(cfg, Path(cfg.run_dir).resolve())
    say(rerun.message(cfg, Path(cfg.run_dir).resolve()))
    if rerun.complete:
        return None
    t0 = time.monotonic()
    cap = cfg.cluster.restart.max_global
    attempt = 0
    while True:
        try:
            summary = run_attempt(cfg, attempt, started=t0, zygote=zygote)
            break
        except RoleFailed as e:
            if STOP.requested:  # a Ctrl-C asked to stop: no restart
                raise
            if attempt >= cap:
                if cap:
                    raise RoleFailed(f"{e}\n(gave up after cluster.restart.max_global={cap} "
                                     "global restarts; see restarts.jsonl)") from e
                raise
            attempt += 1
            record_global_restart(Path(cfg.run_dir).resolve(), attempt, cap, e)
    return summary
