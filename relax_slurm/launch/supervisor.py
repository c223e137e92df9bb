"""Start the roles of a run, watch them, and always tear them down: the `Supervisor`.

Shared by the local runner and the Slurm driver: they differ only in the plan (addresses) and
in how a role's command is wrapped (as is, or in `srun --het-group=K ...`). The steps of an
attempt are functions here (`start`, `watch`); the `Supervisor` holds what they share.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path

from relax_slurm.auth import ensure_secret
from relax_slurm.broker.stats import BrokerStatus
from relax_slurm.checkpoint.resume import find_latest, parse_step
from relax_slurm.config import TrainConfig
from relax_slurm.errors import EngineDown, Preempted, RoleFailed, RoleHung
from relax_slurm.runtime.control import PREEMPT_EXIT_CODE, preempt_requested, read_stop
from relax_slurm.launch.dump import dump_stacks
from relax_slurm.launch.engine_job import EngineJobs
from relax_slurm.launch.health import HangWatch
from relax_slurm.launch.waiting import StallNotes, explain
from relax_slurm.launch.interrupt import STOP
from relax_slurm.runtime.plan import PLAN_FILE, load_plan
from relax_slurm.runtime.stacks import RUN_DIR_ENV
from relax_slurm.launch.processes import ProcessSet, Role
from relax_slurm.runtime.zygote import Zygote
from relax_slurm.launch.records import write_roles
from relax_slurm.launch.restart import InPlace
from relax_slurm.launch.scale import Scaler
from relax_slurm.launch.roles import RoleSpec, Wrap, child_env, engine_api_key, start_order
from relax_slurm.metrics.fanout import check_installed
from relax_slurm.metrics.jsonl import METRICS_FILE, MetricsTail, iter_metrics
from relax_slurm.metrics.notify import Notifier
from relax_slurm.metrics.progress import Progress
from relax_slurm.metrics.summary import first_reached, samples_lost, summarize, write_summary
from relax_slurm.engines.client import wait_until_healthy

POLL_S = 0.5
HANG_DUMP_WAIT_S = 5.0
"""How long the stack dump before a hang's restart waits for the roles to answer: the hung
role may be stopped and never answer, so every hang pays this once; the others answer within
milliseconds (the handler is the interpreter's own, in C)."""


def with_stacks(run_dir: Path, why: str) -> str:
    """`why`, plus where the stacks of every role went: dumped (launch/dump.py) now, before
    the role named hung is killed or the attempt fails, while the evidence is still there."""
    try:
        dump = dump_stacks(run_dir, HANG_DUMP_WAIT_S)
    except Exception as e:  # noqa: BLE001 -- the diagnosis must not stop the recovery
        return f"{why}; no stack dump ({type(e).__name__}: {e})"
    # in the restart's log line and restarts.jsonl's cause, or the failure's message
    return f"{why}; {dump.line()}"


def wait_healthy(procs: ProcessSet, pending: dict[str, Role], timeout_s: float) -> None:
    """Wait for every engine's /health; a role that dies meanwhile, or an engine still down at
    the timeout, fails the run as that role (with its log tail)."""
    try:
        wait_until_healthy(list(pending), timeout_s, POLL_S, between_polls=procs.check_alive)
    except EngineDown as e:
        raise pending[e.url].failure(
            f"did not answer /health within rollout.startup_timeout_s={timeout_s}s") from e


def start(procs: ProcessSet, specs: list[RoleSpec], cfg: TrainConfig, wrap: Wrap) -> Role:
    """Start every role at once, then wait for the engines' /health.

    Starting together overlaps the roles' imports and model loads (~20 s of a run's start-up on
    2 cores); the worker and the trainer wait for the engines themselves before their first
    call. Waiting here as well makes an engine that never comes up fail the run with its own
    log, and a role that dies meanwhile is reported at once.
    """
    pending: dict[str, Role] = {}
    trainer = None
    for spec in start_order(specs):
        role = procs.start(spec.name, wrap(spec), ports=spec.ports, host=spec.host, cpus=spec.cpus)
        if spec.health_url:
            pending[spec.health_url] = role
        if spec.name == "trainer":
            trainer = role
    assert trainer is not None, "a run needs a trainer role"
    procs.order([spec.name for spec in specs])
    wait_healthy(procs, pending, cfg.rollout.startup_timeout_s)
    return trainer


def _preempted(trainer: Role, run_dir: Path, done: int) -> Preempted | None:
    """The trainer's exit while a preemption request was on file (torchrun reports a rank's
    own exit code 75 as its generic 1, so a request on file counts as well): Preempted, the job
    is requeued either way. Whether the trainer answered it is told by its checkpoint: one of
    the last logged step `done` or later; a trainer that died first (a crash in native code
    during the request) is said to have, with its log, and what the next attempt trains again."""
    rc = trainer.proc.poll()
    if rc is None or rc == 0 or not (rc == PREEMPT_EXIT_CODE or preempt_requested(run_dir)):
        return None
    latest = find_latest(run_dir)
    saved = (parse_step(latest) or 0) if latest is not None else 0
    if saved >= done:
        return Preempted(f"trainer stopped on a preemption request after {done} steps, "
                         f"checkpointed (exit code {rc}); it resumes from {latest} when the "
                         "run is started again")
    again = f"steps {saved}-{done - 1}" if done - saved > 1 else f"step {saved}"
    resume = f"from {latest}" if latest is not None else "from the start (no checkpoint)"
    return Preempted(str(trainer.failure(
        f"exited with code {rc} while a preemption request was pending, before it saved the "
        f"checkpoint of its last logged step {done}: it resumes {resume} when the run is "
        f"started again, training {again} again")))


def hung(procs: ProcessSet, name: str, why: str) -> RoleHung:
    """RoleHung naming `name` (a heartbeat name like rollout0 maps to its process, rollout)."""
    role = next((r for r in procs.roles if r.name == name), None) or next(
        (r for r in procs.roles if name.startswith(r.name)), None)
    if role is None:
        return RoleHung(f"role '{name}' {why}")
    return RoleHung(str(role.failure(why)))


def resumed_step(run_dir: Path) -> int:
    """The step of the checkpoint this attempt resumes from (plan.json), 0 for a fresh start."""
    if not (run_dir / PLAN_FILE).exists():
        return 0
    resume = load_plan(run_dir).resume_from
    return (parse_step(resume) or 0) if resume else 0


def watch(procs: ProcessSet, trainer: Role, cfg: TrainConfig, run_dir: Path,
          notifier: Notifier | None = None, hangs: HangWatch | None = None,
          in_place: InPlace | None = None, scaler: Scaler | None = None) -> None:
    """Return when the trainer exits 0; raise Preempted when it stopped on a preemption request
    (see runtime/control.py), RoleHung for a role that stopped heartbeating (see
    launch/health.py) and may not be restarted in place, RoleFailed for any other death or a
    stalled run."""
    start_step = resumed_step(run_dir)
    progress = Progress(cfg.trainer.total_steps, enabled=cfg.metrics.progress,
                        start_step=start_step)
    tail = MetricsTail(run_dir / METRICS_FILE)
    last_step_t = time.monotonic()
    done = start_step
    stalls = StallNotes(cfg.cluster.restart.heartbeat_interval_s)
    try:
        while True:
            for row in tail.new_rows():
                if row.get("step", 0) < start_step:
                    continue  # logged before the checkpoint this attempt resumed from
                progress.update(row)
                if notifier is not None:
                    notifier.on_row(row, cfg.trainer.total_steps)
                last_step_t = time.monotonic()
                done = int(row.get("step", 0)) + 1
                stalls.stepped(row, last_step_t)
            # one poll decides for the trainer: a trainer that exits 0 between two polls must
            # not be reported by check_alive as a role that died
            rc = trainer.proc.poll()
            if rc == 0:
                return
            if rc is not None:
                for row in tail.new_rows():  # logged between this turn's read and its exit
                    done = max(done, int(row.get("step", 0)) + 1)
                preempted = _preempted(trainer, run_dir, done)
                raise preempted or trainer.failure(f"exited with code {rc}")
            if in_place is not None:
                in_place.revive()
            if scaler is not None:
                scaler.tick()  # elastic rollout: start/stop engines the broker asks for
            # a restartable role that died since revive() is the next tick's to restart
            procs.check_alive(skip=("trainer", *(in_place.revivable() if in_place else ())))
            stuck = hangs.check() if hangs is not None else None
            if stuck is not None:
                name, why = stuck[0], with_stacks(run_dir, stuck[1])
                # a silent role that may restart in place does (a hung trainer cannot: global)
                if in_place is None or not in_place.restart_hung(name, why):
                    raise hung(procs, name, why)
            if hangs is not None and hangs.admin_url and stalls.due(time.monotonic(),
                                                                    last_step_t):
                progress.note(f"relax-train: no step for {time.monotonic() - last_step_t:.0f}s "
                              f"after step "
                              f"{done}: {explain(hangs.broker_status())}")
            if time.monotonic() - last_step_t > cfg.cluster.restart.step_timeout_s:
                raise trainer.failure(with_stacks(
                    run_dir, "made no step for cluster.restart.step_timeout_s="
                    f"{cfg.cluster.restart.step_timeout_s}s "
                    "(hung?); see also logs/rollout.log and logs/engine*.log"
                    + (f"; {explain(hangs.broker_status())}" if hangs is not None
                       and hangs.admin_url else "")))
            # the poll's pause, cut short when the trainer exits: every run ends with it, and
            # a plain sleep kept each one waiting ~POLL_S / 2 more for its summary
            with contextlib.suppress(subprocess.TimeoutExpired):
                trainer.proc.wait(timeout=POLL_S)
    finally:
        progress.close()


def run_summary(run_dir: Path, cfg: TrainConfig, wall_s: float, extra: dict | None,
                restarts: dict, final_status: BrokerStatus | None) -> dict:
    """Write summary.json from the metrics; RoleFailed if the trainer stopped short without a
    stop request (runtime/control.py), which it records as `stopped_early` instead."""
    rows = list(iter_metrics(run_dir / METRICS_FILE))
    summary = summarize(rows, wall_s, cfg.algo.max_staleness) | (extra or {})
    summary["restarts"] = restarts
    if final_status is not None:
        summary["samples_lost"] = samples_lost(final_status.counters.to_dict(), rows,
                                               cfg.rollout.batch_size,
                                               cfg.rollout.n_samples_per_prompt)
    target = cfg.trainer.stop_at
    if target.reward is not None:  # where it was reached, stopped there or ended there anyway
        rewarded = [r for r in rows if r.get("rollout/reward_mean") is not None]
        done = first_reached([r["rollout/reward_mean"] for r in rewarded], target.reward,
                             target.steps)
        summary["stop_at"] = {"reward": target.reward, "steps": target.steps,
                              "reached_at_step": None if done is None
                              else rewarded[done - 1]["step"] + 1}
    # by the last step logged, not the row count: a run resumed from another run's
    # checkpoint (resume=PATH) logs only the steps after it in this run dir
    reached = rows[-1]["step"] + 1 if rows else 0
    stop = read_stop(run_dir) if reached < cfg.trainer.total_steps else None
    if stop is not None:
        summary["stopped_early"] = {"at_step": reached, "total_steps": cfg.trainer.total_steps,
                                    "reason": stop.get("reason", "requested")}
    write_summary(run_dir, summary)
    if reached < cfg.trainer.total_steps and stop is None:
        raise RoleFailed(f"trainer exited after step {reached} of {cfg.trainer.total_steps}"
                         f"; see {run_dir / 'logs' / 'trainer.log'}")
    return summary


class Supervisor:
    """One attempt of a run: its roles' processes and the parts that look after them, made
    together and torn down together.

        summary = Supervisor(specs, cfg, run_dir, wrap).run()

    The parts: the processes (launch/processes.py), the hang watch (heartbeats and /server_info,
    launch/health.py), in-place restarts (launch/restart.py), elastic rollout's engines
    (launch/scale.py; on Slurm through `engine_jobs`, launch/engine_job.py) and the
    notifications. `run` (once) starts every role, watches them to the trainer's end
    (`watch`), tears everything down whatever happened, writes summary.json and notifies;
    `restarts` counts the restarts it made, by role. Nothing else is public: a launcher chooses
    the roles (`specs`) and how to run a command (`wrap`), the supervisor does the rest the
    same way everywhere."""

    def __init__(self, specs: list[RoleSpec], cfg: TrainConfig, run_dir: Path, wrap: Wrap,
                 engine_jobs: EngineJobs | None = None, zygote: Zygote | None = None) -> None:
        check_installed(cfg)  # a missing tensorboard/wandb fails now, not after engines load
        self.specs, self.cfg, self.run_dir, self.wrap = specs, cfg, run_dir, wrap
        self.notifier = Notifier(cfg.notify, run_dir.name)
        secret = ensure_secret(run_dir)
        # every role registers its stack dumps under the run dir (runtime/stacks.py)
        self.procs = ProcessSet(run_dir / "logs",
                                child_env(cfg, secret) | {RUN_DIR_ENV: str(run_dir.resolve())},
                                zygote)
        admin = load_plan(run_dir).broker_admin if (run_dir / PLAN_FILE).exists() else None
        self.hangs = HangWatch(admin, secret,
                               {spec.name: spec.health_url for spec in specs if spec.health_url},
                               cfg.cluster.restart.heartbeat_interval_s,
                               cfg.cluster.restart.heartbeat_timeout_s,
                               engine_key=engine_api_key(secret),
                               startup_s=cfg.rollout.startup_timeout_s)
        self.in_place = InPlace(self.procs, specs, wrap, run_dir, cfg.cluster.restart.max_per_role,
                                on_restart=self.hangs.restarted)
        # elastic rollout's process side (launch/scale.py)
        self.scaler = (Scaler(self.procs, cfg, run_dir, admin, secret, wrap,
                              in_place=self.in_place, jobs=engine_jobs) if admin else None)

    def run(self, started: float | None = None, extra: dict | None = None) -> dict:
        """Run the roles to the end; write roles.json and summary.json; return the summary.

        summary.json is written once, also for a failed run: `wall_s` counts from `started` (a
        monotonic time; default now, a restarted run passes its first attempt's) and `extra` is
        merged in (the launcher's own records: global restarts, the Slurm allocation)."""
        t0 = time.monotonic() if started is None else started
        try:
            final_status = self._run_roles()
            summary = run_summary(self.run_dir, self.cfg, time.monotonic() - t0, extra,
                                  self.restarts(), final_status)
        except Preempted as e:
            self.notifier.send("preempted", str(e))
            raise
        except BaseException as e:
            # RoleFailed names the failing role and ends with its log tail
            self.notifier.send("crashed", f"{type(e).__name__}: {e}")
            raise
        self.notifier.send("finished", json.dumps(summary, indent=1))
        return summary

    def restarts(self) -> dict[str, int]:
        """Restarts by role: in place, and of engine jobs' engines (replaced, inside a job)."""
        return self.in_place.counts() | (self.scaler.counts() if self.scaler else {})

    def _run_roles(self) -> BrokerStatus | None:
        """Start every role, watch them until the trainer is done, always tear down; the
        broker's last status (None without a broker)."""
        try:
            trainer = start(self.procs, self.specs, self.cfg, self.wrap)
            STOP.arm(self.run_dir)  # a first Ctrl-C now checkpoints (launch/interrupt.py)
            write_roles(self.procs, self.run_dir)
            self.notifier.send("started", f"{self.cfg.trainer.total_steps} steps, run dir "
                                          f"{self.run_dir}")
            watch(self.procs, trainer, self.cfg, self.run_dir, self.notifier, self.hangs,
                  self.in_place, self.scaler)
            return self.hangs.broker_status()  # the trainer is done; the broker still up
        finally:
            self._close()

    def _close(self) -> None:
        STOP.disarm()
        if self.scaler is not None:
            self.scaler.close()
        self.hangs.close()
        self.procs.close()


def supervise(specs: list[RoleSpec], cfg: TrainConfig, run_dir: Path, wrap: Wrap,
              started: float | None = None, extra: dict | None = None,
              engine_jobs: EngineJobs | None = None, zygote: Zygote | None = None) -> dict:
    """`Supervisor(specs, cfg, run_dir, wrap, engine_jobs, zygote).run(started, extra)`: what
    the local runner and the Slurm driver call for each attempt.

    `engine_jobs` (the Slurm driver's): elastic scale-outs submit engines as Slurm jobs there.
    `zygote` (the local runner's): forks the roles it can (runtime/zygote.py).
    `wall_s` counts from `started`, default now (before the supervisor's parts are made)."""
    t0 = time.monotonic() if started is None else started
    supervisor = Supervisor(specs, cfg, run_dir, wrap, engine_jobs, zygote)
    return supervisor.run(started=t0, extra=extra)
