"""`cluster`: where the roles run, as one of two variants sharing a base.

`ClusterConfig` holds what both launchers read (`kind`, `restart`, `elastic`);
`LocalClusterConfig` (conf/cluster/local.yaml) adds CPU pinning, `SlurmClusterConfig`
(conf/cluster/slurm.yaml) the allocation, preemption, software, container and submission keys
and the Slurm engine jobs' `elastic.job_*`. A key of one variant simply does not exist in the
other, so no launcher can read a key it would ignore (config/variants.py names such a key and
the cluster it belongs to).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from relax_slurm.config.check import check

LOCAL, SLURM = "local", "slurm"


@dataclass(kw_only=True)
class RestartConfig:
    """`cluster.restart`: hang detection (heartbeats, step timeout) and what a failure restarts."""

    max_global: int = 0
    """When a role dies or hangs, stop every role and start the run again from its latest
    checkpoint (trainer.save_every sets how much is redone), at most this many times (on Slurm:
    per allocation, as new srun steps)."""
    max_per_role: int = 3
    """Restarts in place of one role that dies (the broker, from its spill file; see
    operations.md) before its next death fails the run (or restarts it globally)."""
    heartbeat_interval_s: float = 10.0
    """Trainer and rollout worker heartbeat to the broker this often, from their main loops; the
    launcher probes the broker's /status and the engines' /server_info as often."""
    heartbeat_timeout_s: float = 600.0
    """A role whose last heartbeat (or an engine whose last good /server_info, or a broker whose last
    /status) is older than this is hung: the run fails naming it, or restarts
    (cluster.restart.max_global). Cover the longest step; 0 turns hang detection off."""
    step_timeout_s: float = 900.0
    """A run with no new step for this long is failed as hung."""

    def __post_init__(self) -> None:
        check(self.max_global >= 0, f"cluster.restart.max_global={self.max_global}: >= 0")
        check(self.max_per_role >= 0,
              f"cluster.restart.max_per_role={self.max_per_role}: >= 0")
        check(self.heartbeat_interval_s > 0 and (
                  self.heartbeat_timeout_s == 0
                  or self.heartbeat_timeout_s >= 2 * self.heartbeat_interval_s),
              f"cluster.restart.heartbeat_timeout_s={self.heartbeat_timeout_s}: must be 0 (off) "
              f"or at least twice cluster.restart.heartbeat_interval_s="
              f"{self.heartbeat_interval_s} (> 0)")
        check(self.step_timeout_s > 0,
              f"cluster.restart.step_timeout_s={self.step_timeout_s}: must be > 0")


@dataclass(kw_only=True)
class ElasticConfig:
    """`cluster.elastic`: adding and removing engines while the run goes (docs/operations.md).
    On Slurm, `SlurmElasticConfig` adds the engine jobs' resources."""

    timeout_s: float = 600.0
    """A scale_out without timeout_secs fails (and rolls back) after this long."""
    drain_timeout_s: float = 60.0
    """A scale_in waits this long for the worker's requests in flight on the leaving engines,
    then detaches them anyway (force=true does not wait)."""
    max_engines: int = 8
    """A num_replicas scale_out to more engines is refused (each is a process, on Slurm a job,
    with its own copy of the model)."""

    def __post_init__(self) -> None:
        check(self.timeout_s > 0 and self.drain_timeout_s > 0 and self.max_engines >= 1,
              f"cluster.elastic.timeout_s={self.timeout_s} and cluster.elastic.drain_timeout_s="
              f"{self.drain_timeout_s} must be > 0, cluster.elastic.max_engines="
              f"{self.max_engines} >= 1")


@dataclass(kw_only=True)
class SlurmElasticConfig(ElasticConfig):
    """`cluster.elastic` on Slurm: where and on what each added engine's job runs."""

    job_partition: Optional[str] = None
    """Slurm: --partition of the job each added engine runs in; null: the rollout component's
    (cluster.rollout_partition, else cluster.partition)."""
    job_cpus: Optional[int] = None
    """Slurm: --cpus-per-task of an engine job; null: cluster.cpus_per_task."""
    job_gpus: Optional[int] = None
    """Slurm: --gpus-per-node of an engine job; null: rollout.engine_tp_size when the rollout
    component has GPUs (cluster.rollout_gpus_per_node, else cluster.gpus_per_node), else 0."""
    job_time_min: Optional[int] = None
    """Slurm: --time of an engine job, in minutes; null: cluster.time_limit_min."""
    job_mem_gb: Optional[int] = None
    """Slurm: --mem of an engine job in GB; null: the partition's default."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("job_cpus", "job_time_min"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"cluster.elastic.{key}={value}: >= 1 or null")
        for key in ("job_gpus", "job_mem_gb"):
            value = getattr(self, key)
            check(value is None or value >= 0, f"cluster.elastic.{key}={value}: >= 0 or null")


@dataclass(kw_only=True)
class ContainerConfig:
    """`cluster.container` (Slurm): the container every role runs in (pyxis or Apptainer)."""

    image: Optional[str] = None
    """pyxis/enroot image for every role's srun (--container-image); null: no container."""
    mounts: list[str] = field(default_factory=list)
    """--container-mounts entries (SRC:DST); the run directory and the working directory
    must be visible inside."""
    prefix: list[str] = field(default_factory=list)
    """Words put before every role's command inside srun, e.g. [apptainer, exec, --nv,
    image.sif]; the alternative to image for Apptainer/Singularity."""
    python: str = "python"
    """Python inside the container (used when image or prefix is set)."""

    def __post_init__(self) -> None:
        check(not (self.image and self.prefix),
              "cluster.container.image (pyxis) and cluster.container.prefix (apptainer) are "
              "alternatives: set one of them")
        check(not (self.mounts and not self.image),
              "cluster.container.mounts is pyxis's --container-mounts: it needs "
              "cluster.container.image (with an Apptainer prefix put --bind in the prefix)")


@dataclass(kw_only=True)
class ClusterConfig:
    """What both launchers read. A run's `cluster` is one of the variants below (the schema of
    conf/cluster/local.yaml or slurm.yaml), never this base alone."""

    kind: str = LOCAL
    """local (subprocesses on this machine) or slurm (an sbatch job; see docs/slurm.md). Set by
    the choice of cluster=local / cluster=slurm, which also chooses the keys there are."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """Hang detection and restarts (cluster.restart.*)."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Elastic rollout: engines added and removed while the run goes (cluster.elastic.*)."""

    def trainer_node_count(self) -> int:
        """Nodes the trainer's ranks run on: this machine alone unless a Slurm cluster."""
        return 1

    def _check_kind(self, kind: str) -> None:
        # cluster.kind=slurm on the local variant would pick the Slurm launcher without any of
        # its keys: the variant, chosen by the config group, is what decides
        check(self.kind == kind, f"cluster.kind={self.kind!r} with cluster={kind}'s keys: "
              f"choose the cluster with cluster={self.kind} (the group), not cluster.kind")


@dataclass(kw_only=True)
class LocalClusterConfig(ClusterConfig):
    """`cluster=local`: every role a subprocess of the launcher on this machine."""

    kind: str = LOCAL
    trainer_cpus: Optional[list[int]] = None
    """Pin trainer ranks to these CPU ids; null leaves it to the OS."""
    rollout_cpus: Optional[list[int]] = None
    """Pin engines and rollout workers to these CPU ids."""
    fork_roles: bool = True
    """Fork the broker, hf engines, rollout worker and torchrun's agent (and the agent its
    ranks) from processes that imported torch and transformers once (runtime/zygote.py),
    instead of each importing them again: seconds of CPU a run. Only on Linux without a GPU
    on the machine; false starts every role as its own process."""

    def __post_init__(self) -> None:
        self._check_kind(LOCAL)


@dataclass(kw_only=True)
class SlurmClusterConfig(ClusterConfig):
    """`cluster=slurm`: an sbatch job (a heterogeneous one by default), docs/slurm.md."""

    kind: str = SLURM
    elastic: SlurmElasticConfig = field(default_factory=SlurmElasticConfig)
    """Elastic rollout, with the resources of each added engine's job (cluster.elastic.*)."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """The container every role runs in (cluster.container.*)."""

    # ---- slurm: the allocation ------------------------------------------------------------
    layout: str = "hetjob"
    """hetjob (component 0: trainer + broker, component 1: engines + rollout worker) or
    colocated (one plain allocation; rollout roles on the nodes after the trainer's, or on the
    trainer's own nodes when rollout_nodes=0)."""
    partition: Optional[str] = None
    """--partition of the trainer component (and of the rollout one unless rollout_partition)."""
    rollout_partition: Optional[str] = None
    """--partition of the rollout component; null: same as partition."""
    account: Optional[str] = None
    """--account to charge; null: your default account."""
    qos: Optional[str] = None
    """--qos; null: the partition's default."""
    time_limit_min: int = 60
    """--time of each component, in minutes."""
    trainer_nodes: int = 1
    """Nodes running the torchrun trainer (one torchrun agent per node, c10d rendezvous)."""
    rollout_nodes: int = 1
    """Nodes running engines and the rollout worker; colocated layout: 0 shares the trainer's."""
    gpus_per_node: int = 0
    """--gpus-per-node of the trainer component (0: CPU only); match trainer.nproc_per_node."""
    rollout_gpus_per_node: Optional[int] = None
    """--gpus-per-node of the rollout component; null: same as gpus_per_node."""
    cpus_per_task: int = 4
    """--cpus-per-task; every component runs one task per node, so this is CPUs per node."""
    mem_gb: Optional[int] = None
    """--mem per node in GB; null: the partition's default; 0: all of the node's memory."""
    job_name: str = "relax"
    """--job-name; every role's srun step is named after the role."""

    # ---- slurm: preemption and time limits ------------------------------------------------
    requeue: bool = True
    """--requeue: a preempted or time-limited job goes back to the queue and resumes."""
    signal_lead_s: int = 120
    """--signal=B:USR1@N: seconds before the time limit the driver is told to checkpoint and
    requeue (Slurm may deliver it up to ~30 s late; keep it >= 60); 0: no signal."""
    preempt_timeout_s: float = 60.0
    """After that signal, how long the trainer may take to checkpoint and exit before the job is
    requeued anyway (resuming from the previous checkpoint)."""

    # ---- slurm: software on the nodes -----------------------------------------------------
    python: Optional[str] = None
    """Python of the driver and every role on the nodes; null: the one running relax-train."""
    setup_lines: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before the driver (module load, source venv, ...)."""
    extra_sbatch_args: list[str] = field(default_factory=list)
    """More sbatch options for every component, e.g. [--constraint=a100, --exclusive]."""
    extra_srun_args: list[str] = field(default_factory=list)
    """More srun options for every role's step, e.g. [--mpi=none, --cpu-bind=none]."""

    # ---- slurm: submission ----------------------------------------------------------------
    wait: bool = False
    """relax-train blocks until the job ends (requeues included) and exits with its status."""
    wait_poll_s: float = 10.0
    """With wait=true, seconds between two looks at squeue."""
    dry_run: bool = False
    """relax-train prints the sbatch script and the srun lines, and submits nothing."""

    def trainer_node_count(self) -> int:
        return self.trainer_nodes

    def __post_init__(self) -> None:
        self._check_kind(SLURM)
        check(self.layout in ("hetjob", "colocated"),
              f"cluster.layout={self.layout!r}: use hetjob or colocated")
        check(self.trainer_nodes >= 1, f"cluster.trainer_nodes={self.trainer_nodes}: >= 1")
        min_rollout = 1 if self.layout == "hetjob" else 0
        check(self.rollout_nodes >= min_rollout,
              f"cluster.rollout_nodes={self.rollout_nodes}: must be >= {min_rollout} with "
              f"cluster.layout={self.layout} (colocated may share the trainer's nodes with 0)")
        check(self.time_limit_min >= 1, f"cluster.time_limit_min={self.time_limit_min}: >= 1")
        check(self.gpus_per_node >= 0 and (self.rollout_gpus_per_node or 0) >= 0,
              "cluster.gpus_per_node and cluster.rollout_gpus_per_node must be >= 0")
        check(self.cpus_per_task >= 1, f"cluster.cpus_per_task={self.cpus_per_task}: >= 1")
        check(self.mem_gb is None or self.mem_gb >= 0,
              f"cluster.mem_gb={self.mem_gb}: must be >= 0 or null")
        check(0 <= self.signal_lead_s < self.time_limit_min * 60,
              f"cluster.signal_lead_s={self.signal_lead_s}: must be >= 0 and below "
              f"cluster.time_limit_min={self.time_limit_min} minutes")
        check(self.preempt_timeout_s > 0 and (
                  self.signal_lead_s == 0 or self.preempt_timeout_s < self.signal_lead_s),
              f"cluster.preempt_timeout_s={self.preempt_timeout_s}: must be > 0 and below "
              f"cluster.signal_lead_s={self.signal_lead_s} so the requeue happens before the end")
        check(self.wait_poll_s > 0, f"cluster.wait_poll_s={self.wait_poll_s}: must be > 0")
        for arg in self.extra_sbatch_args:  # submitit takes them as parameters: elastic
            # engine jobs and relax_slurm.submit would fail on a short one only when used
            check(arg.startswith("--"), f"cluster.extra_sbatch_args: {arg!r}: use the long "
                  "form --option=value (engine jobs and relax_slurm.submit pass them to submitit)")


CLUSTER_VARIANTS: dict[str, type[ClusterConfig]] = {
    LOCAL: LocalClusterConfig, SLURM: SlurmClusterConfig}
"""cluster.kind -> its variant; the config group conf/cluster/<kind>.yaml has it as schema."""


def slurm_cluster(cluster: ClusterConfig) -> SlurmClusterConfig:
    """`cluster` as the Slurm variant, in code only a Slurm run reaches (the Slurm launcher,
    driver, engine jobs); TypeError, a bug rather than a config error, for another."""
    if not isinstance(cluster, SlurmClusterConfig):
        raise TypeError(f"cluster.kind={cluster.kind}: only a cluster=slurm run gets here")
    return cluster
