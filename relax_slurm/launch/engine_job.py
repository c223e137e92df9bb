"""Elastic rollout on Slurm: each engine a `num_replicas` scale-out adds runs as its own Slurm
job, submitted through submitit from the driver (launch/scale.py calls `EngineJobs`).

    engine job (one node, cluster.elastic.job_*)           the driver (Scaler, every 0.5 s)
    serve(): picks a free port on its node, writes        submit -> op stays PENDING while the
      RUN_DIR/engines/<name>.json {url, job_id, ...}        job waits in the queue and starts
      (atomically), runs the engine server, waits        url file there -> CREATING (urls),
    ...                                                    HEALTH_CHECKING, WEIGHT_SYNCING
    scancel (scale-in after drain, rollback, the         -> `cancel`; the run's end cancels
      run's end) stops it                                   every job it submitted

The engine is the same program as the launch's engines (`roles.engine_spec`: hf engine or
SGLang server), in the run's container if it has one (`job_argv`), bound to its node's Slurm
name, with the run's secret as its API key (read from
RUN_DIR/secret in the job, never on a command line). Its log is RUN_DIR/logs/<name>.log, as for
the launch's engines; submitit's own files are under RUN_DIR/submitit/engines.

An engine that dies in its job is restarted there in place (same URL), up to
cluster.restart.max_per_role times. An engine job also ends by itself when the run's job has left
the queue (polled every PARENT_POLL_S with squeue): a driver killed outright (no `finally`)
leaves no engine job running until its time limit.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_slurm.auth import read_secret
from relax_slurm.config import TrainConfig, load_config
from relax_slurm.config.cluster import slurm_cluster
from relax_slurm.errors import EngineError
from relax_slurm.runtime.lifetime import child_setup
from relax_slurm.launch.roles import child_env, engine_spec
from relax_slurm.launch.slurm_env import node_name, read_allocation, without_job_env
from relax_slurm.launch.slurm_options import container_srun_args, in_container, sbatch_params
from relax_slurm.launch.submitit_jobs import job_classes
from relax_slurm.runtime.ports import free_port

log = logging.getLogger(__name__)
ENGINES_DIR = "engines"
SUBMITIT_SUBDIR = "submitit/engines"
PARENT_POLL_S = 10.0
STATE_POLL_S = 5.0
SLURM_CMD_TIMEOUT_S = 30.0
TERM_GRACE_S = 10.0


def url_file(run_dir: Path, name: str) -> Path:
    return run_dir / ENGINES_DIR / f"{name}.json"


def write_url_file(run_dir: Path, name: str, info: dict[str, Any]) -> None:
    """Write `info` so that a reader sees the whole file or none (tmp + rename)."""
    path = url_file(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def read_url(run_dir: Path, name: str, job_id: str) -> str | None:
    """The URL the engine job `job_id` reported for `name`, or None while it has not (a file
    left by an earlier job of the same name is not taken)."""
    try:
        info = json.loads(url_file(run_dir, name).read_text())
    except (OSError, ValueError):
        return None
    return info["url"] if str(info.get("job_id")) == str(job_id) else None


def job_parameters(cfg: TrainConfig, name: str, workdir: Path) -> dict[str, Any]:
    """submitit SlurmExecutor parameters of one engine job (cluster.elastic.job_*)."""
    c = slurm_cluster(cfg.cluster)
    rollout_gpus = c.gpus_per_node if c.rollout_gpus_per_node is None else c.rollout_gpus_per_node
    gpus = c.elastic.job_gpus if c.elastic.job_gpus is not None else (
        cfg.rollout.engine_tp_size if rollout_gpus else 0)
    extra = sbatch_params(c.extra_sbatch_args)
    extra["no-requeue"] = True  # a preempted engine job is not resumed: the run goes on
    params: dict[str, Any] = dict(
        job_name=f"{c.job_name}-{name}", time=c.elastic.job_time_min or c.time_limit_min,
        nodes=1, ntasks_per_node=1, cpus_per_task=c.elastic.job_cpus or c.cpus_per_task,
        use_srun=False, stderr_to_stdout=True, additional_parameters=extra,
        setup=[f"cd {shlex.quote(str(workdir))}", *c.setup_lines],
    )
    partition = c.elastic.job_partition or c.rollout_partition or c.partition
    mem = None if c.elastic.job_mem_gb is None else (
        f"{c.elastic.job_mem_gb}G" if c.elastic.job_mem_gb else "0")
    for key, value in (("partition", partition), ("account", c.account), ("qos", c.qos),
                       ("gpus_per_node", gpus or None), ("mem", mem)):
        if value is not None:
            params[key] = value
    return params


@contextmanager
def _submit_env() -> Iterator[None]:
    """sbatch from inside the run's job: without that job's SLURM_* variables (see
    slurm_env.without_job_env); restored afterwards."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(without_job_env(saved))
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@dataclass
class EngineJob:
    name: str
    job: Any
    """The submitit Job."""
    url: str | None = None
    ended: bool = False


class EngineJobs:
    """The engine jobs one run submitted (by engine name): submit, find their URLs, notice
    their end, cancel them."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, parent_job: str,
                 workdir: Path | None = None) -> None:
        self.cfg, self.run_dir, self.parent_job = cfg, run_dir, parent_job
        self.workdir = workdir or Path.cwd()
        self.jobs: dict[str, EngineJob] = {}
        self.names_used: set[str] = set()
        """Every name a job was submitted under: never reused (its log, its URL file)."""
        self._checked = 0.0

    def submit(self, name: str, seed: int) -> EngineJob:
        python = slurm_cluster(self.cfg.cluster).python or sys.executable
        try:
            executor = job_classes()(folder=self.run_dir / SUBMITIT_SUBDIR,
                                      python=f"exec {shlex.quote(python)}")
        except RuntimeError as e:  # submitit: no srun on PATH
            raise EngineError(f"submitting an engine job needs the Slurm commands: {e}") from e
        executor.update_parameters(**job_parameters(self.cfg, name, self.workdir))
        with _submit_env():
            job = executor.submit(serve, str(self.run_dir), name, seed, self.parent_job)
        entry = self.jobs[name] = EngineJob(name=name, job=job)
        self.names_used.add(name)
        log.info("engine job %s: %s", job.job_id, name)
        return entry

    def url(self, name: str) -> str | None:
        entry = self.jobs[name]
        if entry.url is None:
            entry.url = read_url(self.run_dir, name, entry.job.job_id)
        return entry.url

    def ended(self, name: str) -> bool:
        """Whether `name`'s job has left the queue (squeue, at most every STATE_POLL_S)."""
        if time.monotonic() - self._checked >= STATE_POLL_S:
            self._checked = time.monotonic()
            live = [e for e in self.jobs.values() if not e.ended]
            if live:
                queued = queued_jobs([e.job.job_id for e in live])
                for e in live:
                    e.ended = queued is not None and e.job.job_id not in queued
        return self.jobs[name].ended

    def info(self, name: str) -> dict[str, Any]:
        """What the job of `name` last wrote in its URL file ({} before it did)."""
        try:
            info = json.loads(url_file(self.run_dir, name).read_text())
        except (OSError, ValueError):
            return {}
        return info if str(info.get("job_id")) == str(self.jobs[name].job.job_id) else {}

    def cancel(self, name: str) -> None:
        entry = self.jobs.pop(name, None)
        if entry is not None and not entry.ended:  # an ended job has nothing left to cancel
            scancel(entry.job.job_id)

    def cancel_all(self) -> None:
        for name in list(self.jobs):
            self.cancel(name)


def queued_jobs(job_ids: list[str]) -> set[str] | None:
    """Those of `job_ids` still in the queue (a het job's `<id>+<k>` rows count as `<id>`);
    None when squeue did not answer."""
    try:
        r = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(job_ids)],
                           capture_output=True, text=True, timeout=SLURM_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return set() if "Invalid job id" in r.stderr else None
    return {row.split("+")[0] for row in r.stdout.split()}


def scancel(job_id: str) -> None:
    try:
        r = subprocess.run(["scancel", job_id], capture_output=True, text=True,
                           timeout=SLURM_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("`scancel %s` failed: %s; cancel it yourself", job_id, e)
        return
    if r.returncode != 0:
        log.error("`scancel %s` failed: %s; cancel it yourself", job_id, r.stderr.strip())


# ---- what runs in the engine job -------------------------------------------------------------

def serve(run_dir: str, name: str, seed: int, parent_job: str) -> int:
    """The engine job's function: run engine `name` on this node until the job is cancelled,
    the run's job `parent_job` has left the queue, or the engine exits (0 or SIGTERM); an
    engine that dies otherwise is restarted in place (same URL), up to
    cluster.restart.max_per_role times. Returns the engine's last exit code."""
    run = Path(run_dir)
    cfg = load_config(run / "config.yaml")
    host = node_name()
    url = f"http://{host}:{free_port(host)}"
    # its own allocation: its GPUs start at 0 whatever the run's layout
    spec = engine_spec(cfg, name, url, cfg.model.path, seed, base_gpu=0, restartable=False)
    argv = job_argv(cfg, name, spec.argv, workdir=os.getcwd())
    env = child_env(cfg, read_secret(run))
    log_path = run / "logs" / f"{name}.log"
    job_id = read_allocation().job_id
    restarts = 0
    proc = _start(argv, env, log_path)
    cancelled: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        # scancel signals every process of the job; submitit's own handler would ignore it
        cancelled.append(signum)
        _signal(proc, signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    write_url_file(run, name, {"url": url, "job_id": job_id, "host": host, "pid": proc.pid})
    print(f"engine job {job_id}: {name} at {url} (pid {proc.pid}, log {log_path})", flush=True)
    try:
        while True:
            try:
                rc = proc.wait(timeout=PARENT_POLL_S)
            except subprocess.TimeoutExpired:
                queued = queued_jobs([parent_job])
                if queued is not None and parent_job not in queued:
                    print(f"the run's job {parent_job} has ended; stopping {name}", flush=True)
                    return 0
                continue
            cap = cfg.cluster.restart.max_per_role
            if cancelled or rc in (0, -signal.SIGTERM) or restarts >= cap:
                return rc
            restarts += 1
            print(f"{name} exited with code {rc}; restarted in place ({restarts} of "
                  f"cluster.restart.max_per_role={cfg.cluster.restart.max_per_role})", flush=True)
            with log_path.open("ab") as f:
                f.write(f"\n--- engine job {job_id}: restarting {name} in place ---\n".encode())
            proc = _start(argv, env, log_path)
            write_url_file(run, name, {"url": url, "job_id": job_id, "host": host,
                                       "pid": proc.pid, "restarts": restarts})
    finally:
        _stop(proc)


def job_argv(cfg: TrainConfig, name: str, argv: list[str], workdir: str) -> list[str]:
    """The engine's command in its job: in the run's container when it has one, as the run's
    own roles are (placement.srun_wrap). pyxis works through srun, so the engine is then a
    step of its job; an Apptainer prefix (cluster.container.prefix) needs none."""
    c = slurm_cluster(cfg.cluster)
    command = in_container(c, argv)
    if not c.container.image:
        return command
    return ["srun", "--nodes=1", "--ntasks=1", f"--job-name={name}", "--kill-on-bad-exit=1",
            *container_srun_args(c, workdir), *c.extra_srun_args, *command]


def _start(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with log_path.open("ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                preexec_fn=child_setup(os.getpid(), None))


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the engine's session, SIGKILL it after TERM_GRACE_S."""
    _signal(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)
        proc.wait(timeout=TERM_GRACE_S)
