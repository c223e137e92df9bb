"""The local runner (cluster=local): every role a subprocess of this one on this machine.

Roles: broker, engines, the teacher engine and the judge engine (`genrm`) if any, rollout worker, torchrun trainer, all
started at once (the worker and trainer wait for the engines' /health). The run ends
when the trainer exits 0; any other exit, or no new step for `cluster.step_timeout_s`, fails
it naming the role and its log. Every child is stopped in `finally`, Ctrl-C included.

With `cluster.max_global_restarts > 0` a failed attempt is followed by a global restart: every
role anew (fresh ports), the trainer from the latest checkpoint in the run directory, the
broker at that version. Each restart is recorded in RUN_DIR/restarts.jsonl and counted in
summary.json (`global_restarts`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from relax_slurm.checkpoint import find_latest, resume_for_attempt
from relax_slurm.config import TrainConfig, save_config
from relax_slurm.data.validate import check_data_files
from relax_slurm.errors import ConfigError, RoleFailed
from relax_slurm.runtime.control import clear_preempt
from relax_slurm.launch.interrupt import STOP
from relax_slurm.runtime.plan import RunPlan, free_port, save_plan
from relax_slurm.launch.rerun import plan_rerun
from relax_slurm.launch.restart import record_restart
from relax_slurm.launch.roles import run_specs
from relax_slurm.launch.supervisor import supervise
from relax_slurm.routing.shape import routing_shape

LOCALHOST = "127.0.0.1"


def check_inputs(cfg: TrainConfig) -> None:
    model = Path(cfg.model.path)
    if not (model / "config.json").is_file():
        raise ConfigError(
            f"model.path={cfg.model.path}: no config.json there. Point model.path at a Hugging "
            "Face model directory, or build the tiny demo model with "
            "`python tools/make_tiny_model.py --out tiny/model`"
        )
    for key, files in (("data.train_files", cfg.data.train_files),
                       ("sft.val_files", cfg.sft.val_files if cfg.supervised else [])):
        for f in files:
            if not Path(f).exists():
                raise ConfigError(
                    f"{key}: {f} does not exist. For the demo data run "
                    "`python tools/prepare_data.py --out tiny`"
                )
    check_teacher(cfg)
    check_judge(cfg)
    if cfg.algo.routing_replay and routing_shape(cfg.model.path) is None:
        raise ConfigError(f"algo.routing_replay=true: model.path={cfg.model.path} is not a "
                          "mixture-of-experts model (its config.json names no experts); "
                          "unset it for a dense model")
    # proxy mode reads no prompts; SFT rows are checked as the trainer reads them
    if cfg.rollout.agent_mode == "env" and not cfg.supervised:
        check_data_files(cfg.data, cfg.eval.datasets if cfg.eval.every else [])


def check_teacher(cfg: TrainConfig) -> None:
    teacher = cfg.algo.teacher_model_path
    if cfg.algo.name == "opd" and not teacher:
        raise ConfigError(
            "algo=opd needs a teacher: set algo.teacher_model_path=DIR (a Hugging Face model "
            "directory with the same tokenizer as model.path); relax-train serves it on one "
            "more hf engine (role `teacher`)"
        )
    if teacher and not (Path(teacher) / "config.json").is_file():
        raise ConfigError(f"algo.teacher_model_path={teacher}: no config.json there. Point it "
                          "at a Hugging Face model directory")


def check_judge(cfg: TrainConfig) -> None:
    judge = cfg.reward.genrm_model_path
    if judge and not (Path(judge) / "config.json").is_file():
        raise ConfigError(f"reward.genrm_model_path={judge}: no config.json there. Point it at a "
                          "Hugging Face model directory, or reward.genrm_url at a judge you run")


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
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    save_plan(plan, run_dir)
    return run_dir


def run_attempt(cfg: TrainConfig, attempt: int, started: float) -> dict:
    plan = local_plan(cfg)  # fresh ports: the last attempt's may not be free yet
    run_dir = prepare_run_dir(cfg, plan, attempt)
    specs = run_specs(cfg, plan, run_dir, LOCALHOST, [LOCALHOST])
    return supervise(specs, cfg, run_dir, wrap=lambda spec: spec.argv, started=started,
                     extra={"global_restarts": attempt})


def record_global_restart(run_dir: Path, attempt: int, cap: int, cause: RoleFailed) -> None:
    resumes = find_latest(run_dir)
    row = {"attempt": attempt, "kind": "global", "cause": str(cause).splitlines()[0],
           "resumes_from": str(resumes) if resumes else None}
    record_restart(run_dir, row)
    # the launcher's own voice, like its errors (Hydra owns the logging config here)
    print(f"relax-train: global restart {attempt} of {cap} ({row['cause']}), from "
          f"{row['resumes_from'] or 'the start'}", file=sys.stderr, flush=True)


def say(text: str | None) -> None:
    if text:
        print(f"relax-train: {text}", file=sys.stderr, flush=True)


def run_local(cfg: TrainConfig) -> dict | None:
    """Run to the end, restarting globally after a failure up to cluster.max_global_restarts;
    returns the summary, None for a run already complete (nothing started, summary.json
    kept). Raises RoleFailed/ConfigError with the cause."""
    check_inputs(cfg)
    rerun = plan_rerun(cfg, Path(cfg.run_dir).resolve())
    say(rerun.message(cfg, Path(cfg.run_dir).resolve()))
    if rerun.complete:
        return None
    t0 = time.monotonic()
    cap = cfg.cluster.max_global_restarts
    attempt = 0
    while True:
        try:
            summary = run_attempt(cfg, attempt, started=t0)
            break
        except RoleFailed as e:
            if STOP.requested:  # a Ctrl-C asked to stop: no restart
                raise
            if attempt >= cap:
                if cap:
                    raise RoleFailed(f"{e}\n(gave up after cluster.max_global_restarts={cap} "
                                     "global restarts; see restarts.jsonl)") from e
                raise
            attempt += 1
            record_global_restart(Path(cfg.run_dir).resolve(), attempt, cap, e)
    return summary
