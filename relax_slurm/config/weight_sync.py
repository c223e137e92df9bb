"""`weight_sync`: how the trainer pushes weights to the engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from relax_slurm.config.check import check
from relax_slurm.config.cluster import ClusterConfig, SlurmClusterConfig

FLATTENED_BUCKET = "flattened_bucket"
"""weight_sync.load_format: one broadcast per bucket."""
TRANSPORTS = ("auto", "distributed", "tensor")


@dataclass(kw_only=True)
class WeightSyncConfig:
    backend: str = "auto"
    """auto (nccl when the trainer sees a GPU and the engines are SGLang's; gloo without GPUs
    and for the hf engine, whose weights are on the CPU), gloo or nccl."""
    bucket_mb: int = 512
    """Tensors are announced to engines in buckets of about this size."""
    timeout_s: float = 300.0
    verify: bool = False
    """After every sync, compare engine and trainer weight checksums (tests, debugging)."""
    overlap: bool = True
    """Async runs (algo.max_staleness >= 1): push each version from a background thread while
    the trainer checkpoints and takes, collates and trains on the next batch; only its
    optimizer step waits for the push (trainer/overlap.py). On-policy runs push in line (the
    worker waits for the new weights anyway). Under FSDP2 or megatron the push keeps a whole
    copy of the weights in rank 0's host memory; one that would not fit in half of what the
    host has available is pushed in line, streamed (said once at start)."""
    load_format: Optional[str] = None
    """null: one broadcast per tensor. flattened_bucket: one broadcast per bucket, its tensors'
    bytes end to end (SGLang's load_format of the same name; the hf engine serves both).
    Fewer collectives for models of many small tensors (MoE experts), at the price of one
    bucket-sized buffer and a copy on the sender (an hf engine receives into its parameters;
    see docs/weight_sync.md)."""
    transport: str = "auto"
    """How a bucket reaches the engines. distributed: broadcast over the weight-update group
    (/update_weights_from_distributed). tensor: by reference, to engines on trainer rank 0's
    node only (/update_weights_from_tensor: CUDA IPC handles on GPUs, shared memory on CPU),
    for engines sharing the trainer's GPUs, where NCCL refuses a group with two ranks on one
    GPU. auto: tensor with rollout.release_memory_during_train when the engines are on rank
    0's node, distributed otherwise (docs/weight_sync.md#transports)."""
    pause_mode: str = "retract"
    """How engines pause while weights are sent (async runs, algo.max_staleness >= 1) and
    before they release memory (colocated): retract (running requests go back to the queue,
    keep their tokens and continue on the new weights; a sample then spans two versions, see
    meta_info.weight_versions), abort (they end with finish_reason abort; the worker continues
    them from their prefix, or with rollout.partial_rollout=false generates their groups
    again). in_place (running requests stay in the batch) is refused when the run is
    configured: every sync flushes the engines' cache, which no supported engine can do beside
    requests paused in place (SGLang 0.5.21 kills its scheduler, 0.5.22+ answer HTTP 400); the
    sender checks each engine's protocol again when the weight-sync group forms."""

    def __post_init__(self) -> None:
        check(self.backend in ("auto", "gloo", "nccl"),
               f"weight_sync.backend={self.backend!r}: use auto, gloo or nccl")
        check(self.pause_mode != "in_place",
              "weight_sync.pause_mode=in_place: every sync flushes the engines' cache, which "
              "no supported engine can do beside requests paused in place (SGLang 0.5.21 kills "
              "its scheduler, 0.5.22+ answer HTTP 400); use retract (running requests go back "
              "to the queue and continue on the new weights) or abort (they end and the worker "
              "continues them from their prefix)")
        check(self.pause_mode in ("abort", "retract"),
              f"weight_sync.pause_mode={self.pause_mode!r}: use retract or abort")
        check(self.transport in TRANSPORTS,
              f"weight_sync.transport={self.transport!r}: use auto, distributed or tensor")
        check(self.load_format in (None, FLATTENED_BUCKET),
               f"weight_sync.load_format={self.load_format!r}: use null (one broadcast per "
               f"tensor) or {FLATTENED_BUCKET}")


def engines_on_trainer_host(cluster: ClusterConfig) -> bool:
    """Every engine on trainer rank 0's node: a local run, or a colocated Slurm job of one node
    (cluster.trainer_nodes=1, cluster.rollout_nodes=0)."""
    if isinstance(cluster, SlurmClusterConfig):
        return (cluster.layout == "colocated" and cluster.rollout_nodes == 0
                and cluster.trainer_nodes == 1)
    return True


def resolve_transport(ws: WeightSyncConfig, release_memory_during_train: bool,
                      cluster: ClusterConfig) -> str:
    """weight_sync.transport with auto decided: distributed or tensor."""
    if ws.transport != "auto":
        return ws.transport
    shares = release_memory_during_train and engines_on_trainer_host(cluster)
    return "tensor" if shares else "distributed"
