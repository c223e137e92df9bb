"""How a run asks Slurm for resources and runs its steps, as options: the sbatch options of a
het component (`component_options`, for the rendered script and for submitit), the
`--key=value` options of cluster.extra_sbatch_args as submitit parameters (`sbatch_params`), and
a step's container (`container_srun_args`, `in_container`). Pure functions of the cluster config.

Used by the sbatch script (launch/sbatch.py), `relax_slurm.submit` (launch/submit.py), the
Slurm driver's srun lines (launch/placement.py) and the engine jobs (launch/engine_job.py).
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from typing import Any, Sequence

from relax_slurm.config.cluster import SlurmClusterConfig
from relax_slurm.errors import ConfigError


def component_options(c: SlurmClusterConfig, group: int) -> list[str]:
    """sbatch options of one het component (or of the whole job when colocated)."""
    if group == 0:
        nodes = c.trainer_nodes + (c.rollout_nodes if c.layout == "colocated" else 0)
        gpus, partition = c.gpus_per_node, c.partition
    else:
        nodes = c.rollout_nodes
        gpus = c.gpus_per_node if c.rollout_gpus_per_node is None else c.rollout_gpus_per_node
        partition = c.rollout_partition or c.partition
    opts = [f"--partition={partition}"] if partition else []
    opts += [f"--account={c.account}"] if c.account else []
    opts += [f"--qos={c.qos}"] if c.qos else []
    opts += [f"--time={c.time_limit_min}", f"--nodes={nodes}", "--ntasks-per-node=1",
             f"--cpus-per-task={c.cpus_per_task}"]
    opts += [f"--gpus-per-node={gpus}"] if gpus else []
    opts += [f"--mem={c.mem_gb}G" if c.mem_gb else "--mem=0"] if c.mem_gb is not None else []
    return opts + list(c.extra_sbatch_args)


def sbatch_params(args: Sequence[str]) -> dict[str, Any]:
    """["--constraint=a100", "--exclusive"] -> {"constraint": "a100", "exclusive": True}."""
    out: dict[str, Any] = {}
    for arg in args:
        if not arg.startswith("--"):
            raise ConfigError(f"cluster.extra_sbatch_args: {arg!r}: use the long form "
                              "--option=value with submit()")
        key, eq, value = arg[2:].partition("=")
        out[key] = value if eq else True
    return out


def container_srun_args(c: SlurmClusterConfig, workdir: str) -> list[str]:
    """srun options of a step in the run's pyxis container (cluster.container.image), or []."""
    if not c.container.image:
        return []
    # a named container: pyxis imports the image once per node and the job's later steps (every
    # role, restarts) reuse it, instead of unpacking a multi-GB image for each step; named after
    # the image, so a run with another image never starts in this one's container
    name = "relax_" + hashlib.sha1(c.container.image.encode()).hexdigest()[:12]
    args = [f"--container-image={c.container.image}", f"--container-name={name}",
            f"--container-workdir={workdir}"]
    if c.container.mounts:
        args.append(f"--container-mounts={','.join(c.container.mounts)}")
    return args


def in_container(c: SlurmClusterConfig, command: list[str]) -> list[str]:
    """A role's command as run inside the container (cluster.container.prefix before it, the
    container's Python for ours); unchanged without a container."""
    if not (c.container.image or c.container.prefix):
        return list(command)
    # this interpreter's path means nothing inside the image: it is swapped wherever the role
    # names it, not only as the first word (`env K=V python ...`, and the SGLang engine's
    # `bash -c 'exec env K=V python ... --api-key "$KEY"'`, which keeps the key off the
    # command line): there its first word of its own
    host, inside = sys.executable, c.container.python
    command = [inside if arg == host else arg for arg in command]
    if command[:2] == ["bash", "-c"] and len(command) > 2:
        command[2] = command[2].replace(f" {shlex.quote(host)} ", f" {shlex.quote(inside)} ", 1)
    return [*c.container.prefix, *command]
