"""Where a run's roles go in a Slurm allocation, and the srun line of each: pure functions of
the config and the allocation, shared by the driver in the allocation (launch/slurm_driver.py)
and the dry run before submitting (launch/sbatch.py), so the two show the same steps.

    srun --het-group=K --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=HOSTS --overlap \\
         [--gpus-per-node=0] --job-name=ROLE --kill-on-bad-exit=1 [container flags] ROLE-COMMAND

A step gets every GPU of the job on its nodes unless it asks otherwise (srun(1), --gres), and
before Slurm 22.05 `--overlap` shared CPUs only: a broker's step took the trainer node's GPUs
and the trainer's step waited forever. Roles that hold no GPU (the broker, the rollout worker,
hf engines on the CPU) ask for none with --gpus-per-node=0, which Slurm 22.05 takes in a job
that asked for GPUs either way (--gpus-per-node or --gres=gpu) or not at all; --gres=none is
refused in a --gpus-per-node job ("Invalid Trackable RESource (TRES) specification", seen on the
test cluster). Two GPU steps on one node need Slurm >= 22.05.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from relax_slurm.config import TrainConfig
from relax_slurm.config.cluster import slurm_cluster
from relax_slurm.errors import ConfigError
from relax_slurm.launch.roles import RoleSpec, Wrap, run_specs
from relax_slurm.launch.slurm_env import SlurmAllocation
from relax_slurm.launch.slurm_options import container_srun_args, in_container
from relax_slurm.runtime.plan import RunPlan
from relax_slurm.runtime.ports import free_port

ANY_HOST = "0.0.0.0"
GPU_STEP_SHARING = (22, 5)
"""The first Slurm whose --overlap lets steps share GRES (GPUs), not only CPUs."""


@dataclass(frozen=True)
class Layout:
    """Which nodes run what. `het`: steps name their component with --het-group."""

    trainer_hosts: tuple[str, ...]
    rollout_hosts: tuple[str, ...]
    het: bool


def make_layout(cfg: TrainConfig, alloc: SlurmAllocation) -> Layout:
    """hetjob: component 0 trains, component 1 rolls out. colocated: one node list, trainer on
    the first cluster.trainer_nodes nodes, rollout on the rest (or on the trainer's nodes)."""
    if alloc.is_het:
        if len(alloc.het_groups) != 2:
            raise ConfigError(
                f"the job has {len(alloc.het_groups)} het components; relax-slurm expects 2 "
                "(0: trainer + broker, 1: rollout). Use sbatch/train_hetjob.sbatch or "
                "cluster.layout=colocated for a plain job")
        return Layout(trainer_hosts=alloc.het_groups[0], rollout_hosts=alloc.het_groups[1],
                      het=True)
    nodes = alloc.het_groups[0]
    t = cfg.cluster.trainer_node_count()
    if len(nodes) < t:
        raise ConfigError(
            f"the allocation has {len(nodes)} node(s) but cluster.trainer_nodes={t}; request "
            f"more nodes or lower cluster.trainer_nodes")
    return Layout(trainer_hosts=nodes[:t], rollout_hosts=nodes[t:] or nodes, het=False)


def slurm_plan(cfg: TrainConfig, layout: Layout) -> RunPlan:
    """Addresses by node name. Ports are ones free on this node now: nodes of one job are
    alike, and a role that cannot bind fails loudly and names its port."""
    if cfg.supervised:  # SFT: the trainer alone, rendezvous on its first node
        return RunPlan(broker_router="", broker_pub="", trainer_master_port=free_port(ANY_HOST))
    head, rollout = layout.trainer_hosts[0], layout.rollout_hosts
    n = cfg.rollout.num_engines
    teacher = int(bool(cfg.algo.teacher_model_path))
    return RunPlan(
        broker_router=f"tcp://{head}:{free_port(ANY_HOST)}",
        broker_pub=f"tcp://{head}:{free_port(ANY_HOST)}",
        broker_admin=f"http://{head}:{free_port(ANY_HOST)}",
        engine_urls=[f"http://{rollout[i % len(rollout)]}:{free_port(ANY_HOST)}"
                     for i in range(n)],
        # on-policy distillation's teacher engine: next in the round robin after the engines
        teacher_url=(f"http://{rollout[n % len(rollout)]}:{free_port(ANY_HOST)}"
                     if cfg.algo.teacher_model_path else None),
        # the managed judge (reward.genrm_model_path): next after the teacher
        genrm_url=(f"http://{rollout[(n + teacher) % len(rollout)]}:{free_port(ANY_HOST)}"
                   if cfg.reward.genrm_model_path else None),
        # the rollout worker runs on the first rollout node
        proxy_url=(f"http://{rollout[0]}:{cfg.rollout.proxy_port or free_port(ANY_HOST)}"
                   if cfg.rollout.agent_mode == "proxy" else None),
        weight_sync_host="",  # wherever trainer rank 0 lands (the trainer resolves it)
        weight_sync_port=free_port(ANY_HOST),
        trainer_master_port=free_port(ANY_HOST),
    )


def role_specs(cfg: TrainConfig, plan: RunPlan, layout: Layout, run_dir: Path) -> list[RoleSpec]:
    specs = run_specs(cfg, plan, run_dir, layout.rollout_hosts[0], list(layout.trainer_hosts))
    # CPU pinning is for local runs: here it would pin the srun client, not the role
    return [dataclasses.replace(s, cpus=None) for s in specs]


def holds_gpus(cfg: TrainConfig, spec: RoleSpec) -> bool:
    """Whether a role's process uses GPUs: the trainer, and SGLang engines (the policy's, the
    teacher, the judge); the broker, the worker and the hf engine (on the CPU) do not."""
    if spec.name == "trainer":
        return True
    return spec.name not in ("broker", "rollout") and cfg.rollout.engine != "hf"


def check_gpu_steps(cfg: TrainConfig, specs: list[RoleSpec], layout: Layout,
                    version: tuple[int, int] | None) -> None:
    """Refuse two GPU steps on one node before Slurm 22.05 (each would take all the node's
    GPUs, and the second would wait for the first to end). `version`: None if unknown."""
    if version is None or version >= GPU_STEP_SHARING:
        return
    per_node: dict[str, list[str]] = {}
    for spec in specs:
        if holds_gpus(cfg, spec):
            hosts = layout.trainer_hosts if spec.name == "trainer" else (spec.host,)
            for host in hosts:
                per_node.setdefault(host, []).append(spec.name)
    shared = {h: names for h, names in per_node.items() if len(names) > 1}
    if shared:
        host, names = next(iter(shared.items()))
        raise ConfigError(
            f"Slurm {version[0]}.{version[1]:02d} gives each job step all of a node's GPUs "
            f"(--overlap shares GPUs from 22.05 on), and node {host} would run {names}: the "
            "second would wait forever. Use Slurm >= 22.05, or one GPU role per node "
            "(rollout.num_engines <= cluster.rollout_nodes, cluster.layout=hetjob)")


def slurm_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of `srun --version` ("slurm 22.05.8", "slurm-wlm 23.11.4"); None if it
    says something else."""
    parts = text.split()
    if len(parts) < 2:
        return None
    nums = parts[1].split(".")
    try:
        return int(nums[0]), int(nums[1])
    except (ValueError, IndexError):
        return None


def srun_wrap(cfg: TrainConfig, layout: Layout, workdir: str) -> Wrap:
    """spec -> `srun ... argv` for its nodes (all trainer nodes for the trainer)."""
    c = slurm_cluster(cfg.cluster)

    def wrap(spec: RoleSpec) -> list[str]:
        hosts = layout.trainer_hosts if spec.name == "trainer" else (spec.host,)
        n = len(hosts)
        argv = ["srun"]
        if layout.het:
            argv.append(f"--het-group={spec.het_group}")
        argv += [f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
                 f"--nodelist={','.join(hosts)}", "--overlap"]
        if not holds_gpus(cfg, spec):
            argv.append("--gpus-per-node=0")  # else the step holds every GPU of the job on its node
        argv += [f"--job-name={spec.name}", "--kill-on-bad-exit=1"]
        argv += container_srun_args(c, workdir) + c.extra_srun_args
        return [*argv, *in_container(c, spec.argv)]

    return wrap
