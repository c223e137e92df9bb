"""A dedicated process group for weight sync: trainer rank 0 plus every engine rank.

Formed the way SGLang's `init_custom_process_group` does it (itself taken from PyTorch and
OpenRLHF): a TCPStore at `master_address:master_port` hosted by rank 0 (what the `tcp://`
rendezvous SGLang uses creates), a PrefixStore named after the group, and
`torch.distributed.distributed_c10d._new_process_group_helper`. The group is registered in
`_world.pg_group_ranks` with an identity rank map so `dist.broadcast(t, src=0, group=pg)` works.

It does not touch the default group: callable from a torchrun rank that already has one
(the trainer) and from a process that has none (an engine server).
"""

from __future__ import annotations

import inspect
import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from relax_slurm.errors import WeightSyncError

log = logging.getLogger(__name__)


def resolve_backend(backend: str, engines_on_gpu: bool = True) -> str:
    """Map weight_sync.backend (auto, gloo, nccl) to the backend the group will use.
    `engines_on_gpu`: the engines receive into CUDA tensors (SGLang); the hf engine's weights
    are on the CPU, where an NCCL receive fails at once."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and engines_on_gpu else "gloo"
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"weight-sync backend {backend!r}: use auto, gloo or nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise WeightSyncError("weight-sync backend nccl needs CUDA, and this process sees no GPU: "
                              "set weight_sync.backend=gloo (or auto)")
    return backend


def host_store(master_address: str, port: int, world_size: int, group_name: str,
               timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0: bind the group's store now, before any engine is told where it is.

    `port` was chosen by the launcher when the run started, and the engines load their models
    before the trainer binds it: another process may have taken it in between (seen on a busy
    machine, a test's SGLang servers). A port in use is not a slow peer, so it is never waited
    on: the store binds a port the OS picks instead, and the engines are told the store's port.
    """
    timeout = timedelta(seconds=timeout_s)

    def bind(at: int) -> dist.TCPStore:
        return dist.TCPStore(master_address, at, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False)

    try:
        return bind(port)
    except dist.DistNetworkError as e:
        planned = e
    # whatever the bind's reason (its text is torch's, not an API), a port of the OS's choosing
    # tells a taken port (this binds) from an address this host cannot listen on (this fails too)
    try:
        store = bind(0)
    except dist.DistNetworkError as e:
        raise WeightSyncError(f"weight-sync group {group_name!r}: could not host its store on "
                              f"{master_address} (port {port}: {planned}; a free port: {e})"
                              ) from e
    log.warning("weight-sync group %r: could not bind port %d (%s); hosting on port %d "
                "instead (the engines are told)", group_name, port, planned, store.port)
    return store


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, backend: str = "gloo",
                             timeout_s: float = 300.0,
                             store: dist.Store | None = None) -> dist.ProcessGroup:
    """Join (rank 0: host) the group; blocks until all `world_size` ranks arrived or timeout_s.
    `store`: rank 0's, from `host_store` (then `master_port` is its port)."""
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"weight-sync group {group_name!r}: rank {rank} outside world size "
                              f"{world_size}")
    backend = resolve_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    where = (f"weight-sync group {group_name!r} at {master_address}:{master_port} "
             f"(rank {rank} of {world_size}, {backend})")
    try:
        if store is None:  # an engine rank (or a rank 0 hosting here: tests)
            store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                                  timeout=timeout)
        prefix_store = c10d.PrefixStore(group_name, store)
        params = inspect.signature(c10d._new_process_group_helper).parameters
        options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                               prefix_store, group_name=group_name,
                                               timeout=timeout, **options)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    except Exception as e:  # store timeouts, port in use, a duplicate group name, backend errors
        raise WeightSyncError(f"could not form {where} within {timeout_s}s: {e}. Check that every "
                              "engine was told the same address/port/world size and can reach "
                              "the address") from e
    log.info("formed %s", where)
    return pg


def destroy_weight_update_group(pg: dist.ProcessGroup | None) -> None:
    """Tear the group down; never raises (teardown runs in finally blocks)."""
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except Exception as e:  # already destroyed, or the peer died
        log.warning("destroying weight-sync group failed: %s", e)

