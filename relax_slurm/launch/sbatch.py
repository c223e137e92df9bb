"""`relax-train ... cluster=slurm`: render the run's sbatch script, submit it, optionally wait.

    relax-train experiment=X cluster=slurm cluster.partition=gpu        # submit, print job id
    relax-train experiment=X cluster=slurm cluster.wait=true            # ... and wait for the end
    relax-train experiment=X cluster=slurm cluster.dry_run=true         # print script + srun lines

The script is rendered from `TEMPLATE`: one `#SBATCH` block per het component (0: trainer +
broker, 1: engines + rollout worker; a single block for cluster.layout=colocated), then the
driver (`relax_slurm.launch.slurm_driver`), which starts every role with its own `srun` step.
It is written to `RUN_DIR/job.sbatch`, next to `config.yaml`, so the run can be resubmitted by
hand (`sbatch RUN_DIR/job.sbatch`) and resumes from its checkpoints.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from relax_slurm.auth import logs_dir
from relax_slurm.config import TrainConfig, save_config
from relax_slurm.config.cluster import SlurmClusterConfig, slurm_cluster
from relax_slurm.errors import ConfigError, RelaxError
from relax_slurm.launch.placement import make_layout, role_specs, slurm_plan, srun_wrap
from relax_slurm.launch.slurm_env import SlurmAllocation
from relax_slurm.launch.slurm_options import component_options
from relax_slurm.runtime.control import read_status

SCRIPT_NAME = "job.sbatch"
SBATCH_TIMEOUT_S = 120
SQUEUE_RETRIES = 5
TEMPLATE = """\
#!/bin/bash
{{header}}
{{sbatch}}

set -eo pipefail
{{setup}}
# exec: the driver replaces this shell, so Slurm's B:USR1 (preemption/time limit) reaches it
exec {{driver}}
"""
DRIVER = "-m relax_slurm.launch.slurm_driver"


def fill(template: str, **values: str) -> str:
    """Replace every {{name}}; an unknown or missing name is an error, not a blank."""
    out = re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], template)
    assert "{{" not in out, out
    return out


def sbatch_lines(c: SlurmClusterConfig, output: str) -> list[str]:
    """Every #SBATCH line: job-wide options first (they belong to component 0), then one block
    per component, separated by `#SBATCH hetjob`."""
    job = [f"--job-name={c.job_name}", f"--output={sbatch_quote(output)}", "--open-mode=append",
           "--requeue" if c.requeue else "--no-requeue"]
    job += [f"--signal=B:USR1@{c.signal_lead_s}"] if c.signal_lead_s else []
    lines = [f"#SBATCH {o}" for o in job + component_options(c, 0)]
    if c.layout == "hetjob":
        lines += ["#SBATCH hetjob"] + [f"#SBATCH {o}" for o in component_options(c, 1)]
    return lines


def sbatch_quote(value: str) -> str:
    """An #SBATCH option's value as sbatch reads it: words split at white space, double quotes
    group them (backslash escapes `"` and `\\`); shlex.quote's single quotes are not sbatch's."""
    if re.fullmatch(r"[\w@%+=:,./-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def job_python(c: SlurmClusterConfig) -> str:
    return c.python or sys.executable


def job_cluster(cfg: TrainConfig) -> SlurmClusterConfig:
    """The cluster settings the job is rendered from: an SFT run (`algo=sft`, the trainer
    alone) is one plain component of cluster.trainer_nodes, whatever the layout says."""
    if cfg.supervised:
        return dataclasses.replace(slurm_cluster(cfg.cluster), layout="colocated", rollout_nodes=0)
    return slurm_cluster(cfg.cluster)


def render_script(cfg: TrainConfig, run_dir: Path, workdir: Path) -> str:
    """The sbatch script of one run (its config.yaml already in run_dir)."""
    c = job_cluster(cfg)
    script = shlex.quote(str(run_dir / SCRIPT_NAME))
    header = (f"# relax-slurm run {run_dir}\n"
              f"# Rendered by relax-train (relax_slurm/launch/sbatch.py). Resubmit with `sbatch "
              f"{script}`:\n"
              "# the run resumes from its latest checkpoint in the same run directory.")
    return fill(TEMPLATE, header=header,
                sbatch="\n".join(sbatch_lines(c, f"{run_dir}/slurm-%j.out")),
                setup="\n".join([f"cd {shlex.quote(str(workdir))}", *c.setup_lines]),
                driver=f"{shlex.quote(job_python(c))} {DRIVER} --run-dir "
                       f"{shlex.quote(str(run_dir))}")


# The ready scripts in sbatch/: (cluster settings, overrides the script passes, description).
# `python -m relax_slurm.launch.sbatch --write-presets` rewrites them; a unit test checks that
# the files match.
_GPU_NODE = dict(kind="slurm", gpus_per_node=8, cpus_per_task=32, mem_gb=0, time_limit_min=240)
PRESETS: dict[str, tuple[SlurmClusterConfig, list[str], str]] = {
    "train_hetjob": (
        SlurmClusterConfig(layout="hetjob", trainer_nodes=1, rollout_nodes=1, **_GPU_NODE), [],
        "Heterogeneous job: component 0 = 1 node with the torchrun trainer (8 GPUs) and the\n"
        "# broker; component 1 = 1 node with the engines and the rollout worker."),
    "train_colocated": (
        SlurmClusterConfig(layout="colocated", trainer_nodes=1, rollout_nodes=0, **_GPU_NODE),
        ["cluster.layout=colocated", "cluster.trainer_nodes=1", "cluster.rollout_nodes=0"],
        "One plain allocation of 1 node: trainer, broker, engines and rollout worker share it\n"
        "# (set trainer.nproc_per_node to the GPUs the trainer takes)."),
    "train_multinode": (
        SlurmClusterConfig(layout="hetjob", trainer_nodes=2, rollout_nodes=2, **_GPU_NODE), [],
        "Heterogeneous job, multi-node: component 0 = 2 trainer nodes x 8 GPUs (one torchrun\n"
        "# agent per node, c10d rendezvous on the first) + the broker; component 1 = 2 rollout\n"
        "# nodes (engines spread over them). Use trainer.nproc_per_node=8."),
}


def render_preset(name: str) -> str:
    c, fixed, what = PRESETS[name]
    header = (f"# {what}\n#\n"
              f"#   sbatch sbatch/{name}.sbatch experiment=X key=value ...\n#\n"
              "# Arguments are Hydra overrides, as for relax-train. Edit the #SBATCH lines for "
              "your\n"
              "# cluster, or override them on the command line, where an option applies to every\n"
              f"# component: sbatch -p gpu -A myproj sbatch/{name}.sbatch ...\n"
              "# The run directory defaults to runs/slurm-<job id>; a requeued attempt (--signal,\n"
              "# preemption) resumes there. RELAX_PYTHON: the interpreter with relax-slurm\n"
              "# installed (default: python on PATH). See docs/slurm.md.")
    driver_args = " ".join([*fixed, '"$@"'])
    return fill(TEMPLATE, header=header, sbatch="\n".join(sbatch_lines(c, "slurm-%x-%j.out")),
                setup="# module load ... / source .venv/bin/activate: here",
                driver=f'"${{RELAX_PYTHON:-python}}" {DRIVER} --compose {driver_args}')


def example_allocation(c: SlurmClusterConfig) -> SlurmAllocation:
    """A made-up allocation of the requested size, to show the srun lines before submitting."""
    trainer = tuple(f"trainer-node{i + 1}" for i in range(c.trainer_nodes))
    rollout = tuple(f"rollout-node{i + 1}" for i in range(c.rollout_nodes))
    if c.layout == "colocated":
        return SlurmAllocation(job_id="JOBID", het_groups=(trainer + rollout,))
    return SlurmAllocation(job_id="JOBID", het_groups=(trainer, rollout), is_het=True)


def srun_lines(cfg: TrainConfig, run_dir: Path, workdir: Path) -> list[str]:
    layout = make_layout(cfg, example_allocation(job_cluster(cfg)))
    plan = slurm_plan(cfg, layout)
    wrap = srun_wrap(cfg, layout, str(workdir))
    return [shlex.join(wrap(s)) for s in role_specs(cfg, plan, layout, run_dir)]


def dry_run_text(cfg: TrainConfig, run_dir: Path, workdir: Path) -> str:
    example = "; ".join(f"component {k}: {','.join(g)}" for k, g in
                        enumerate(example_allocation(job_cluster(cfg)).het_groups))
    lines = srun_lines(cfg, run_dir, workdir)
    shebang, script = render_script(cfg, run_dir, workdir).split("\n", 1)
    return (f"{shebang}\n"
            f"# DRY RUN (cluster.dry_run=true): nothing was written or submitted. Without it,\n"
            f"# relax-train writes this script to {run_dir / SCRIPT_NAME} and submits it.\n"
            f"{script}\n"
            f"# The driver then starts one srun step per role (nodes as in an allocation of\n"
            f"# {example}; ports are chosen in the allocation):\n"
            + "\n".join(lines) + "\n")


def _run(cmd: list[str], timeout_s: float = SBATCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as e:
        raise ConfigError(f"`{cmd[0]}` not found: cluster=slurm needs the Slurm client commands "
                          "(run relax-train on a login node, or use cluster=local)") from e
    except subprocess.TimeoutExpired as e:
        raise RelaxError(f"`{shlex.join(cmd)}` did not answer within {timeout_s}s") from e


def submit_script(script: Path) -> str:
    """`sbatch --parsable SCRIPT` -> job id."""
    r = _run(["sbatch", "--parsable", str(script)])
    if r.returncode != 0:
        raise RelaxError(f"sbatch {script} failed: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout.strip().split(";")[0]


def job_states(job_id: str) -> list[str]:
    """States of the job's components in squeue; [] once the job has left the queue."""
    r = _run(["squeue", "-h", "-j", job_id, "-o", "%T"], timeout_s=60)
    if r.returncode != 0:
        if "Invalid job id" in r.stderr:
            return []
        raise RelaxError(f"squeue -j {job_id} failed: {r.stderr.strip()}")
    return r.stdout.split()


def wait_for_job(job_id: str, run_dir: Path, poll_s: float) -> dict:
    """Block until the job has left the queue (requeues included); return its final status.

    A busy slurmctld sometimes fails a query ("Socket timed out"): only SQUEUE_RETRIES
    failures in a row end the wait (the job itself is not affected either way)."""
    last: list[str] = []
    failures = 0
    while True:
        try:
            states = job_states(job_id)
            failures = 0
        except RelaxError as e:
            failures += 1
            if failures > SQUEUE_RETRIES:
                raise RelaxError(f"{e} ({failures} times in a row); job {job_id} may still be "
                                 f"running: `squeue -j {job_id}`, `scancel {job_id}`") from e
            print(f"job {job_id}: {e}; retrying", flush=True)
            time.sleep(max(poll_s, 1.0))
            continue
        if states != last and states:
            print(f"job {job_id}: {' '.join(sorted(set(states)))}", flush=True)
        last = states
        if not states:
            break
        time.sleep(poll_s)
    status = read_status(run_dir) or {"state": "unknown"}
    if status["state"] in ("running", "requeued"):  # gone without the driver saying how it ended
        status = {**status, "state": "failed",
                  "message": f"job {job_id} ended without the driver reporting (killed? time "
                             f"limit?); see {run_dir}/slurm-{job_id}.out"}
    return status


def submit_run(cfg: TrainConfig) -> str | None:
    """Print the dry run, or write the run directory and submit its script: the job id, or
    None when nothing was submitted (a dry run, or a run complete already)."""
    from relax_slurm.launch.inputs import check_inputs, say
    from relax_slurm.launch.rerun import plan_rerun

    run_dir, workdir = Path(cfg.run_dir).resolve(), Path.cwd()
    cfg.run_dir = str(run_dir)
    if slurm_cluster(cfg.cluster).dry_run:
        print(dry_run_text(cfg, run_dir, workdir), end="")
        return None
    check_inputs(cfg)
    fresh = not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} <= {".hydra"}
    rerun = plan_rerun(cfg, run_dir)  # refuse now, not in the queue (records its history)
    say(rerun.message(cfg, run_dir))
    if rerun.complete:
        return None
    try:
        logs_dir(run_dir)
        save_config(cfg, run_dir / "config.yaml")
        script = run_dir / SCRIPT_NAME
        script.write_text(render_script(cfg, run_dir, workdir))
        job_id = submit_script(script)
    except (RelaxError, OSError):
        if fresh:  # refused by sbatch: no half-made run directory (a rerun's is kept as it was)
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    print(f"submitted job {job_id}\nrun directory: {run_dir}\n"
          f"slurm log: {run_dir}/slurm-{job_id}.out", flush=True)
    return job_id


def report_job(job_id: str, run_dir: Path, poll_s: float) -> dict:
    """Wait for the job's end (wait_for_job), print its state and, if it completed, its
    summary; return the final status."""
    status = wait_for_job(job_id, run_dir, poll_s)
    print(f"job {job_id}: {status['state']}"
          + (f": {status['message']}" if status.get("message") else ""), flush=True)
    summary = run_dir / "summary.json"
    if status["state"] == "completed" and summary.is_file():
        print(summary.read_text(), end="")
    return status


def run_sbatch(cfg: TrainConfig) -> int:
    """The relax-train entry for cluster=slurm: dry run, or submit (and wait). Exit code."""
    job_id = submit_run(cfg)
    if job_id is None or not slurm_cluster(cfg.cluster).wait:
        return 0
    try:
        status = report_job(job_id, Path(cfg.run_dir), slurm_cluster(cfg.cluster).wait_poll_s)
    except KeyboardInterrupt:
        print(f"stopped waiting; job {job_id} keeps running (`scancel {job_id}` stops it)",
              flush=True)
        return 130
    return 0 if status["state"] == "completed" else 1


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m relax_slurm.launch.sbatch",
                                     description="Rewrite the ready scripts in sbatch/.")
    parser.add_argument("--write-presets", type=Path, metavar="DIR", required=True)
    args = parser.parse_args(argv)
    args.write_presets.mkdir(parents=True, exist_ok=True)
    for name in PRESETS:
        path = args.write_presets / f"{name}.sbatch"
        path.write_text(render_preset(name))
        path.chmod(0o755)
        print(path)


if __name__ == "__main__":
    main()
