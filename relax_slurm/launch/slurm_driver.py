"""The driver inside a Slurm allocation: `python -m relax_slurm.launch.slurm_driver --run-dir DIR`.

It runs on the first node of het component 0 (the batch host), reads the allocation from
Slurm's environment (`slurm_env`), places the roles, and starts each one as its own job step:

    srun --het-group=K --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=HOSTS --overlap \\
         --job-name=ROLE --kill-on-bad-exit=1 [container flags] ROLE-COMMAND

with the same role commands and the same supervisor as the local runner. `--overlap` lets the
steps share the allocation (without it a second step on a node waits for the first).

Preemption and time limits: Slurm sends SIGUSR1 `cluster.signal_lead_s` before the end
(`#SBATCH --signal=B:USR1@N`; the batch shell `exec`s this driver so it is the one signalled).
The driver asks the trainer to checkpoint and stop (`control.request_preempt`); when the trainer
has stopped, the supervisor raises `Preempted` and the driver runs `scontrol requeue` on its own
job. The next attempt, same job id and run directory, clears the request and starts every role
again; the trainer resumes from its latest checkpoint (`resume=auto`). A trainer that has not
stopped within `cluster.preempt_timeout_s` is not waited for: the job is requeued anyway and the
next attempt resumes from the latest complete checkpoint.

A stop (`relax-ctl stop`, `control.request_stop`) is not a preemption: the trainer saves a final
checkpoint and exits 0, the supervisor returns the summary (with `stopped_early`), and the
attempt is recorded `completed`; no requeue. A new job clears a stop left in its run dir; a
requeued attempt keeps it.

`--compose OVERRIDES...` (used by the ready scripts in sbatch/) composes the config here first,
with `run_dir` defaulting to `runs/slurm-<job id>` so that a requeued attempt finds its run.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from relax_slurm.auth import logs_dir
from relax_slurm.checkpoint import find_latest, resume_for_attempt
from relax_slurm.config import TrainConfig, load_config
from relax_slurm.config.cluster import slurm_cluster
from relax_slurm.errors import NodesLost, Preempted, RelaxError, RoleFailed
from relax_slurm.runtime.control import (
    PREEMPT_EXIT_CODE, clear_preempt, clear_stop, read_status, request_preempt, write_status,
)
from relax_slurm.launch.engine_job import EngineJobs
from relax_slurm.launch.inputs import check_inputs, record_global_restart
from relax_slurm.launch.node_health import lost_nodes
from relax_slurm.runtime.lifetime import adopt_orphans
from relax_slurm.launch.records import record_restart
from relax_slurm.runtime.plan import save_plan
from relax_slurm.launch.placement import (Layout, check_gpu_steps, make_layout, role_specs,
                                         slurm_plan, slurm_version, srun_wrap)
from relax_slurm.launch.roles import RoleSpec, Wrap
from relax_slurm.launch.slurm_env import SlurmAllocation, read_allocation
from relax_slurm.launch.supervisor import supervise

log = logging.getLogger("relax_slurm.slurm")
REQUEUE_TIMEOUT_S = 60


def requeue(job_id: str) -> None:
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                           timeout=REQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RoleFailed(f"`scontrol requeue {job_id}` failed: {e}") from e
    if r.returncode != 0:
        raise RoleFailed(f"`scontrol requeue {job_id}` failed: {r.stderr.strip()}; the "
                         "checkpoint is kept: resubmit with the same run_dir to resume")


class PreemptSignal:
    """SIGUSR1: ask the trainer to checkpoint and stop; if it has not stopped within
    cluster.preempt_timeout_s, requeue anyway (it then resumes from its previous checkpoint)."""

    def __init__(self, run_dir: Path, alloc: SlurmAllocation, cfg: TrainConfig) -> None:
        self.run_dir, self.alloc, self.cfg = run_dir, alloc, cfg
        self.timer: threading.Timer | None = None
        self.forced = False

    def __call__(self, signum: int, frame: object) -> None:
        log.warning("got %s: asking the trainer to checkpoint and stop",
                    signal.Signals(signum).name)
        request_preempt(self.run_dir, reason=signal.Signals(signum).name)
        c = slurm_cluster(self.cfg.cluster)
        if self.timer is None and c.requeue:
            self.timer = threading.Timer(c.preempt_timeout_s, self._force)
            self.timer.daemon = True
            self.timer.start()

    def _force(self) -> None:
        log.error("the trainer did not stop within cluster.preempt_timeout_s=%ss; requeueing "
                  "job %s without a fresh checkpoint",
                  slurm_cluster(self.cfg.cluster).preempt_timeout_s,
                  self.alloc.job_id)
        self.forced = True
        write_status(self.run_dir, "requeued", job_id=self.alloc.job_id,
                     attempt=self.alloc.restart_count,
                     message="the trainer did not stop within cluster.preempt_timeout_s; "
                             "the next attempt resumes from the latest complete checkpoint")
        try:
            requeue(self.alloc.job_id)
        except RoleFailed as e:
            log.error("%s", e)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _terminate(signum: int, frame: object) -> None:
    # scancel, the time limit and a requeue send SIGTERM: stop every step in supervise's finally
    raise KeyboardInterrupt


def _requeue_sigterm(signum: int, frame: object) -> None:
    # our own `scontrol requeue` ends this attempt with SIGTERM; the roles are already stopped
    log.info("SIGTERM from the requeue: this attempt ends")


def slurm_info(alloc: SlurmAllocation, layout: Layout, specs: list[RoleSpec]) -> dict:
    """Where this attempt put each role (slurm.json, and the summary's "slurm" section)."""
    return {
        "job_id": alloc.job_id, "attempt": alloc.restart_count, "het": layout.het,
        "trainer_hosts": list(layout.trainer_hosts), "rollout_hosts": list(layout.rollout_hosts),
        "roles": {s.name: {"het_group": s.het_group if layout.het else 0,
                           "hosts": list(layout.trainer_hosts) if s.name == "trainer"
                           else [s.host]}
                  for s in specs},
    }


def installed_slurm_version() -> tuple[int, int] | None:
    """This allocation's Slurm release, from `srun --version` (None if it cannot tell)."""
    try:
        out = subprocess.run(["srun", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return slurm_version(out.stdout) if out.returncode == 0 else None


def prepare(cfg: TrainConfig, alloc: SlurmAllocation, run_dir: Path, global_restart: int = 0
            ) -> tuple[list[RoleSpec], Wrap, dict]:
    """Place the roles on this allocation, resolve the resume point, write plan.json and
    slurm.json; return the role specs, the srun wrap and the placement.

    A requeued attempt (SLURM_RESTART_COUNT > 0) and a global restart inside this allocation
    both resume from the run's latest checkpoint; fresh ports for either."""
    layout = make_layout(cfg, alloc)
    plan = slurm_plan(cfg, layout)
    resume = resume_for_attempt(run_dir, cfg.resume, cfg.overwrite,
                                alloc.restart_count + global_restart)
    plan.resume_from = str(resume) if resume else None
    save_plan(plan, run_dir)
    specs = role_specs(cfg, plan, layout, run_dir)
    check_gpu_steps(cfg, specs, layout, installed_slurm_version())
    wrap = srun_wrap(cfg, layout, workdir=str(Path.cwd()))
    info = slurm_info(alloc, layout, specs) | {"global_restart": global_restart}
    (run_dir / "slurm.json").write_text(json.dumps(info, indent=2))
    log.info("attempt %d%s %s", alloc.restart_count,
             f", global restart {global_restart}" if global_restart else "",
             f"resumes from {resume}" if resume else "starts fresh")
    for spec in specs:
        log.info("%s: %s", spec.name, shlex.join(wrap(spec)))
    return specs, wrap, info


def check_nodes(run_dir: Path, info: dict, failure: RoleFailed) -> None:
    """Raise NodesLost (recorded in restarts.jsonl) if a node of the allocation is down,
    drained or not responding: new steps there would fail too (launch/node_health.py)."""
    lost = lost_nodes([*info["trainer_hosts"], *info["rollout_hosts"]])
    if not lost:
        return
    nodes = ", ".join(f"{n} ({s})" for n, s in lost.items())
    resumes = find_latest(run_dir)
    cause = str(failure).splitlines()[0].removesuffix(" Last lines:")  # (its log tail follows)
    record_restart(run_dir, {"kind": "requeue", "cause": cause, "lost_nodes": lost,
                             "resumes_from": str(resumes) if resumes else None})
    raise NodesLost(f"{cause}; node(s) {nodes} of the allocation lost: the job is requeued "
                    f"and resumes from {resumes or 'the start'} on other nodes") from failure


def run_attempts(cfg: TrainConfig, alloc: SlurmAllocation, run_dir: Path,
                 status: Callable[..., None]) -> dict:
    """Supervise the roles to the end. A failure the supervisor cannot mend in place (a dead or
    hung trainer, a role out of cluster.restart.max_per_role) stops every step and starts every
    role again as new srun steps, from the latest checkpoint, up to
    cluster.restart.max_global times in this allocation (as the local runner does,
    launch/local.py). If a node of the allocation was lost, NodesLost instead: drive()
    requeues the job, as for Preempted, which is not a failure either."""
    cap, started = cfg.cluster.restart.max_global, time.monotonic()
    restart = 0
    while True:
        specs, wrap, info = prepare(cfg, alloc, run_dir, restart)
        status("running")
        try:
            return supervise(specs, cfg, run_dir, wrap, started=started,
                             extra={"slurm": info, "global_restarts": restart},
                             engine_jobs=EngineJobs(cfg, run_dir, parent_job=alloc.job_id))
        except RoleFailed as e:
            check_nodes(run_dir, info, e)  # NodesLost: requeue rather than restart here
            if restart >= cap:
                if cap:
                    raise RoleFailed(f"{e}\n(gave up after cluster.restart.max_global={cap} "
                                     "global restarts; see restarts.jsonl)") from e
                raise
            restart += 1
            record_global_restart(run_dir, restart, cap, e)


def drive(run_dir: str | Path, alloc: SlurmAllocation | None = None) -> dict:
    """Run the roles of `run_dir` (config.yaml written) in this allocation; return the summary.

    Records the outcome in slurm_status.json. Raises Preempted after requeueing the job (unless
    cluster.requeue=false), RelaxError for a failed run."""
    run_dir = Path(run_dir).resolve()
    alloc = alloc or read_allocation()
    status = functools.partial(write_status, run_dir, job_id=alloc.job_id,
                               attempt=alloc.restart_count)
    on_usr1: PreemptSignal | None = None
    try:
        cfg = load_config(run_dir / "config.yaml")
        clear_preempt(run_dir)  # a request from the attempt before must not stop this one
        if alloc.restart_count == 0:  # nor a stop that ended an earlier job's run; a
            clear_stop(run_dir)  # requeued attempt keeps one asked for before: it stops
        on_usr1 = PreemptSignal(run_dir, alloc, cfg)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, on_usr1)
            signal.signal(signal.SIGTERM, _terminate)
        summary = run_attempts(cfg, alloc, run_dir, status)
    except Preempted as e:
        on_usr1.cancel()
        if not slurm_cluster(cfg.cluster).requeue:
            status("preempted", message=str(e))
            raise
        status("requeued", message=str(e))
        log.warning("%s; requeueing job %s", e, alloc.job_id)
        if threading.current_thread() is threading.main_thread():
            # the requeue SIGTERMs this process at once, maybe before scontrol has returned:
            # _terminate's KeyboardInterrupt would report the attempt as terminated (exit 143)
            signal.signal(signal.SIGTERM, _requeue_sigterm)
        try:
            requeue(alloc.job_id)
        except RoleFailed as failed:
            status("preempted", message=f"{e}; {failed}")
            raise failed from e
        raise
    except RelaxError as e:
        status("failed", message=str(e))
        raise
    except KeyboardInterrupt:
        if on_usr1 is None or not on_usr1.forced:  # (a forced requeue has said so already)
            status("terminated", message="SIGTERM (scancel or the time limit)")
        raise
    finally:
        if on_usr1 is not None:
            on_usr1.cancel()
    status("completed")
    return summary


def compose_run_dir(overrides: list[str], alloc: SlurmAllocation) -> Path | None:
    """Compose the config of a ready sbatch script (sbatch/*.sbatch) and write its run_dir;
    None when that run is complete already (nothing to do; launch/rerun.py).

    A requeued attempt reuses the config.yaml its first attempt wrote."""
    from relax_slurm.launch.rerun import plan_rerun

    from relax_slurm.config import save_config
    from relax_slurm.launch.compose import compose_config, slurm_overrides

    cfg = compose_config(slurm_overrides(overrides, default_run_dir=f"runs/slurm-{alloc.job_id}"))
    run_dir = Path(cfg.run_dir).resolve()
    if alloc.restart_count > 0 and (run_dir / "config.yaml").is_file():
        return run_dir
    check_inputs(cfg)
    cfg.run_dir = str(run_dir)
    rerun = plan_rerun(cfg, run_dir)  # a changed config is refused here, as by relax-train
    message = rerun.message(cfg, run_dir)
    if message:
        log.info("%s", message)
    if rerun.complete:
        return None
    logs_dir(run_dir)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_slurm.launch.slurm_driver",
                                     description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--run-dir", type=Path, help="a run directory with config.yaml")
    group.add_argument("--compose", nargs=argparse.REMAINDER, metavar="OVERRIDE",
                       help="Hydra overrides (experiment=X key=value ...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(message)s",
                        stream=sys.stdout)
    t0 = time.monotonic()
    adopt_orphans()  # a dead role's orphans come here, to be stopped (launch/processes.py)
    try:
        alloc = read_allocation()
        run_dir = args.run_dir if args.compose is None else compose_run_dir(args.compose, alloc)
        if run_dir is None:
            return 0
        log.info("job %s attempt %d, run directory %s", alloc.job_id, alloc.restart_count,
                 Path(run_dir).resolve())
        summary = drive(run_dir, alloc)
    except Preempted as e:
        print(f"relax-slurm driver: {e}", flush=True)
        requeued = (read_status(run_dir) or {}).get("state") == "requeued"
        return 0 if requeued else PREEMPT_EXIT_CODE
    except RelaxError as e:
        print(f"relax-slurm driver: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("relax-slurm driver: terminated; every step of the run was stopped", flush=True)
        return 143
    print(json.dumps(summary, indent=2))
    print(f"relax-slurm driver: run finished in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
