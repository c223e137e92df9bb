"""`cluster`: where the roles run (local or Slurm), hang detection, restarts, elastic rollout."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Optional

from relax_slurm.config.check import check

LOCAL, SLURM = "local", "slurm"


def only_on(kind: str, default: Any = MISSING, *, factory: Any = MISSING) -> Any:
    """A field that only the `kind` launcher reads. Declared here, with the field, so that a new
    one cannot be forgotten: set away from its default under the other cluster.kind it is
    refused (`ignored_fields`) rather than silently doing nothing."""
    return field(default=default, default_factory=factory, metadata={"only_on": kind})


def ignored_fields(section: Any, kind: str, prefix: str = "cluster") -> list[str]:
    """`prefix.name=value` of every field of `section` (its sub-sections included) that only
    another kind's launcher reads and that is set away from its default."""
    out = []
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            out += ignored_fields(value, kind, f"{prefix}.{f.name}")
            continue
        only = f.metadata.get("only_on")
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if only is not None and only != kind and value != default:
            out.append(f"{prefix}.{f.name}={value!r}")
    return out


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
    launcher probes the broker's /status and the engines' /health as often."""
    heartbeat_timeout_s: float = 600.0
    """A role whose last heartbeat (or an engine whose last good /health, or a broker whose last
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
    """`cluster.elastic`: adding and removing engines while the run goes (docs/operations.md)."""

    timeout_s: float = 600.0
    """A scale_out without timeout_secs fails (and rolls back) after this long."""
    drain_timeout_s: float = 60.0
    """A scale_in waits this long for the worker's requests in flight on the leaving engines,
    then detaches them anyway (force=true does not wait)."""
    max_engines: int = 8
    """A num_replicas scale_out to more engines is refused (each is a process, on Slurm a job,
    with its own copy of the model)."""
    job_partition: Optional[str] = only_on(SLURM, None)
    """Slurm: --partition of the job each added engine runs in; null: the rollout component's
    (cluster.rollout_partition, else cluster.partition)."""
    job_cpus: Optional[int] = only_on(SLURM, None)
    """Slurm: --cpus-per-task of an engine job; null: cluster.cpus_per_task."""
    job_gpus: Optional[int] = only_on(SLURM, None)
    """Slurm: --gpus-per-node of an engine job; null: rollout.engine_tp_size when the rollout
    component has GPUs (cluster.rollout_gpus_per_node, else cluster.gpus_per_node), else 0."""
    job_time_min: Optional[int] = only_on(SLURM, None)
    """Slurm: --time of an engine job, in minutes; null: cluster.time_limit_min."""
    job_mem_gb: Optional[int] = only_on(SLURM, None)
    """Slurm: --mem of an engine job in GB; null: the partition's default."""

    def __post_init__(self) -> None:
        check(self.timeout_s > 0 and self.drain_timeout_s > 0 and self.max_engines >= 1,
              f"cluster.elastic.timeout_s={self.timeout_s} and cluster.elastic.drain_timeout_s="
              f"{self.drain_timeout_s} must be > 0, cluster.elastic.max_engines="
              f"{self.max_engines} >= 1")
        for key in ("job_cpus", "job_time_min"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"cluster.elastic.{key}={value}: >= 1 or null")
        for key in ("job_gpus", "job_mem_gb"):
            value = getattr(self, key)
            check(value is None or value >= 0, f"cluster.elastic.{key}={value}: >= 0 or null")


@dataclass(kw_only=True)
class ContainerConfig:
    """`cluster.container`: the container every role runs in on Slurm (pyxis or Apptainer)."""

    image: Optional[str] = only_on(SLURM, None)
    """pyxis/enroot image for every role's srun (--container-image); null: no container."""
    mounts: list[str] = only_on(SLURM, factory=list)
    """--container-mounts entries (SRC:DST); the run directory and the working directory
    must be visible inside."""
    prefix: list[str] = only_on(SLURM, factory=list)
    """Words put before every role's command inside srun, e.g. [apptainer, exec, --nv,
    image.sif]; the alternative to image for Apptainer/Singularity."""
    python: str = only_on(SLURM, "python")
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
    kind: str = "local"
    """local (subprocesses on this machine) or slurm (an sbatch job; see docs/slurm.md)."""
    trainer_cpus: Optional[list[int]] = only_on(LOCAL, None)
    """Pin trainer ranks to these CPU ids (local runs); null leaves it to the OS."""
    rollout_cpus: Optional[list[int]] = only_on(LOCAL, None)
    """Pin engines and rollout workers to these CPU ids (local runs)."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """Hang detection and restarts (cluster.restart.*)."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Elastic rollout: engines added and removed while the run goes (cluster.elastic.*)."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Slurm: the container every role runs in (cluster.container.*)."""

    # ---- slurm: the allocation ------------------------------------------------------------
    layout: str = only_on(SLURM, "hetjob")
    """hetjob (component 0: trainer + broker, component 1: engines + rollout worker) or
    colocated (one plain allocation; rollout roles on the nodes after the trainer's, or on the
    trainer's own nodes when rollout_nodes=0)."""
    partition: Optional[str] = only_on(SLURM, None)
    """--partition of the trainer component (and of the rollout one unless rollout_partition)."""
    rollout_partition: Optional[str] = only_on(SLURM, None)
    """--partition of the rollout component; null: same as partition."""
    account: Optional[str] = only_on(SLURM, None)
    """--account to charge; null: your default account."""
    qos: Optional[str] = only_on(SLURM, None)
    """--qos; null: the partition's default."""
    time_limit_min: int = only_on(SLURM, 60)
    """--time of each component, in minutes."""
    trainer_nodes: int = only_on(SLURM, 1)
    """Nodes running the torchrun trainer (one torchrun agent per node, c10d rendezvous)."""
    rollout_nodes: int = only_on(SLURM, 1)
    """Nodes running engines and the rollout worker; colocated layout: 0 shares the trainer's."""
    gpus_per_node: int = only_on(SLURM, 0)
    """--gpus-per-node of the trainer component (0: CPU only); match trainer.nproc_per_node."""
    rollout_gpus_per_node: Optional[int] = only_on(SLURM, None)
    """--gpus-per-node of the rollout component; null: same as gpus_per_node."""
    cpus_per_task: int = only_on(SLURM, 4)
    """--cpus-per-task; every component runs one task per node, so this is CPUs per node."""
    mem_gb: Optional[int] = only_on(SLURM, None)
    """--mem per node in GB; null: the partition's default; 0: all of the node's memory."""
    job_name: str = only_on(SLURM, "relax")
    """--job-name; every role's srun step is named after the role."""

    # ---- slurm: preemption and time limits ------------------------------------------------
    requeue: bool = only_on(SLURM, True)
    """--requeue: a preempted or time-limited job goes back to the queue and resumes."""
    signal_lead_s: int = only_on(SLURM, 120)
    """--signal=B:USR1@N: seconds before the time limit the driver is told to checkpoint and
    requeue (Slurm may deliver it up to ~30 s late; keep it >= 60); 0: no signal."""
    preempt_timeout_s: float = only_on(SLURM, 60.0)
    """After that signal, how long the trainer may take to checkpoint and exit before the job is
    requeued anyway (resuming from the previous checkpoint)."""

    # ---- slurm: software on the nodes -----------------------------------------------------
    python: Optional[str] = only_on(SLURM, None)
    """Python of the driver and every role on the nodes; null: the one running relax-train."""
    setup_lines: list[str] = only_on(SLURM, factory=list)
    """Shell lines run in the batch script before the driver (module load, source venv, ...)."""
    extra_sbatch_args: list[str] = only_on(SLURM, factory=list)
    """More sbatch options for every component, e.g. [--constraint=a100, --exclusive]."""
    extra_srun_args: list[str] = only_on(SLURM, factory=list)
    """More srun options for every role's step, e.g. [--mpi=none, --cpu-bind=none]."""

    # ---- slurm: submission ----------------------------------------------------------------
    wait: bool = only_on(SLURM, False)
    """relax-train blocks until the job ends (requeues included) and exits with its status."""
    wait_poll_s: float = only_on(SLURM, 10.0)
    """With wait=true, seconds between two looks at squeue."""
    dry_run: bool = only_on(SLURM, False)
    """relax-train prints the sbatch script and the srun lines, and submits nothing."""

    def __post_init__(self) -> None:
        check(self.kind in (LOCAL, SLURM), f"cluster.kind={self.kind!r}: use local or slurm")
        # a key the chosen launcher never reads would do nothing: say so instead of running
        # (cluster.partition=gpu without cluster=slurm runs on this machine, not on gpu)
        ignored = ignored_fields(self, self.kind)
        other = SLURM if self.kind == LOCAL else LOCAL
        one = len(ignored) == 1
        check(not ignored,
              f"{', '.join(ignored)}: {'applies' if one else 'apply'} to cluster.kind={other} "
              f"only (cluster.kind={self.kind} ignores {'it' if one else 'them'}); run with "
              f"cluster={other}, or leave {'it' if one else 'them'} at the default")
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
