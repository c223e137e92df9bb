"""Submit a run from Python through submitit; get back its `Job`.

    import relax_slurm
    job = relax_slurm.submit(["experiment=tiny_cpu", "cluster.partition=gpu", "run_dir=runs/a"])
    job.job_id, job.state          # "RUNNING", ... ("REQUEUED"/"PENDING" while requeued)
    summary = job.result()         # the run's summary.json, once the run has finished
    job.cancel()

The job is the same heterogeneous job as `relax-train cluster=slurm` renders (component 0:
trainer + broker, component 1: engines + rollout worker), with the same driver
(`slurm_driver.drive`) running in component 0. submitit 1.5 has no het-job option, so component
1 is added as `#SBATCH hetjob` lines in its `setup`, and sacct's `<id>+<k>` rows are read back
with a small watcher fix (submitit would report such a job as UNKNOWN forever).

Preemption works as with sbatch: `--signal=B:USR1@<cluster.signal_lead_s>` reaches the submitit
process (it `exec`s the batch shell), the driver checkpoints, requeues and ends the attempt
without a result; submitit runs the function again in the requeued job, which resumes, and
`result()` returns the summary of the finished run.
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from relax_slurm.auth import logs_dir
from relax_slurm.config import TrainConfig, save_config
from relax_slurm.config.cluster import slurm_cluster
from relax_slurm.errors import ConfigError, Preempted
from relax_slurm.launch.compose import compose_config, slurm_overrides
from relax_slurm.launch.slurm_options import component_options, sbatch_params
from relax_slurm.launch.submitit_jobs import job_classes
from relax_slurm.runtime.control import PREEMPT_EXIT_CODE, read_status

SUBMITIT_DIR = "submitit"


def run_in_allocation(run_dir: str) -> dict:
    """What the submitted job runs (component 0, first node): the driver; returns the summary."""
    from relax_slurm.launch.slurm_driver import drive

    logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(message)s",
                        stream=sys.stdout)
    try:
        return drive(run_dir)
    except Preempted as e:
        if (read_status(run_dir) or {}).get("state") != "requeued":
            raise
        # requeued: end this attempt without a result; the next attempt returns the summary
        print(f"relax-slurm driver: {e}", flush=True)
        raise SystemExit(PREEMPT_EXIT_CODE) from e


def executor_parameters(cfg: TrainConfig, workdir: Path) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for the run's het job (or plain job when colocated)."""
    c = slurm_cluster(cfg.cluster)
    extra = sbatch_params(c.extra_sbatch_args)
    extra["requeue" if c.requeue else "no-requeue"] = True
    if c.signal_lead_s:
        extra["signal"] = f"B:USR1@{c.signal_lead_s}"  # replaces submitit's own USR2 signal
    nodes = c.trainer_nodes + (c.rollout_nodes if c.layout == "colocated" else 0)
    params: dict[str, Any] = dict(
        job_name=c.job_name, time=c.time_limit_min, nodes=nodes, ntasks_per_node=1,
        cpus_per_task=c.cpus_per_task, use_srun=False, additional_parameters=extra,
        stderr_to_stdout=True,
    )
    # submitit writes `mem` as given (--mem=64 would be 64 MB): give it the unit, as
    # component_options does for the other component
    mem = None if c.mem_gb is None else (f"{c.mem_gb}G" if c.mem_gb else "0")
    for key, value in (("partition", c.partition), ("account", c.account), ("qos", c.qos),
                       ("gpus_per_node", c.gpus_per_node or None), ("mem", mem)):
        if value is not None:
            params[key] = value
    setup = []
    if c.layout == "hetjob":
        setup = ["#SBATCH hetjob", *(f"#SBATCH {o}" for o in component_options(c, 1))]
    params["setup"] = [*setup, f"cd {shlex.quote(str(workdir))}", *c.setup_lines]
    return params


def submit(cfg: TrainConfig | Sequence[str]) -> Any:
    """Submit a run (a TrainConfig, or Hydra overrides as for relax-train) as a Slurm job through
    submitit; returns the `submitit.Job`, whose `result()` is the run's summary, or None when
    the run directory holds a complete run (nothing is submitted). A resume whose config
    changes what a step computes is refused (ConfigError naming the keys) unless
    resume_with_changes=true, as by relax-train (launch/rerun.py)."""
    if not isinstance(cfg, TrainConfig):
        cfg = compose_config(slurm_overrides(list(cfg)))
    from relax_slurm.launch.inputs import check_inputs, say
    from relax_slurm.launch.rerun import plan_rerun

    run_dir, workdir = Path(cfg.run_dir).resolve(), Path.cwd()
    cfg.run_dir = str(run_dir)
    check_inputs(cfg)
    rerun = plan_rerun(cfg, run_dir)  # refuse now, not in the queue
    say(rerun.message(cfg, run_dir))
    if rerun.complete:
        return None
    logs_dir(run_dir)
    save_config(cfg, run_dir / "config.yaml")
    python = slurm_cluster(cfg.cluster).python or sys.executable
    try:
        executor = job_classes()(folder=run_dir / SUBMITIT_DIR,
                                  python=f"exec {shlex.quote(python)}")
    except RuntimeError as e:  # submitit: no srun on PATH
        raise ConfigError(f"submit() needs the Slurm client commands: {e}") from e
    executor.update_parameters(**executor_parameters(cfg, workdir))
    return executor.submit(run_in_allocation, str(run_dir))
