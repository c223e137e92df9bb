"""Trainer rank 0's side of weight sync: one group with N engines, buckets of broadcasts.

Protocol (the one SGLang servers implement, see docs/weight_sync.md):
  connect: POST /init_weights_update_group to every engine (engine i is rank 1+i of a group of
           1+N) while rank 0 joins; the HTTP calls return once the group has formed.
  send:    per bucket, POST /update_weights_from_distributed {names, dtypes, shapes} to every
           engine, and meanwhile broadcast each tensor of the bucket from rank 0 in the order of
           `names` (or, with load_format=flattened_bucket, the bucket's bytes end to end in one
           broadcast); then the HTTP calls return once the engines loaded the bucket.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from relax_slurm.errors import EngineError, WeightSyncError
from relax_slurm.rollout.engine_client import EngineClient
from relax_slurm.weightsync.bucket import (bucket_named_tensors, dtype_name, flatten_bucket,
                                           tensor_nbytes)
from relax_slurm.weightsync.group import (destroy_weight_update_group, init_weight_update_group,
                                          resolve_backend)
from relax_slurm.weightsync.receiver import tensor_sha256

log = logging.getLogger(__name__)


class WeightSender:
    """Push full (gathered, HF-named) tensors from trainer rank 0 to a cohort of engines."""

    def __init__(self, engine_urls: Sequence[str], master_addr: str, master_port: int,
                 group_name: str = "weight_update_group", backend: str = "auto",
                 timeout_s: float = 300.0, bucket_mb: float = 512.0,
                 pause_mode: Optional[str] = "in_place", ranks_per_engine: int = 1,
                 load_format: Optional[str] = None) -> None:
        if not engine_urls:
            raise WeightSyncError("WeightSender needs at least one engine URL")
        self.engine_urls = list(engine_urls)
        self.master_addr = master_addr
        self.master_port = master_port
        self.group_name = group_name
        self.backend = resolve_backend(backend)
        self.timeout_s = timeout_s
        self.bucket_mb = bucket_mb
        self.pause_mode = pause_mode
        """Pause engines around a multi-bucket send so no batch sees half-updated weights;
        None disables (SGLang: in_place keeps running requests, abort returns them)."""
        self.ranks_per_engine = ranks_per_engine
        """Group ranks of one engine: its TP size (SGLang: rank = rank_offset + tp_rank; every
        TP rank receives the full tensor and keeps its shard)."""
        self.load_format = load_format
        """None: one broadcast per tensor; flattened_bucket: one per bucket (bucket.py)."""
        self.world_size = 1 + len(self.engine_urls) * ranks_per_engine
        self.clients = [EngineClient(u, timeout_s) for u in self.engine_urls]
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients),
                                        thread_name_prefix="weight-sync-http")
        self._group_thread = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="weight-sync-group")
        self._pg: Optional[dist.ProcessGroup] = None
        self._inflight: list = []  # broadcast works of the bucket being sent

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")

    def _on_engines(self, call: Callable[[EngineClient, int], Any]) -> list[Future]:
        """Run call(client, engine_index) for every engine concurrently."""
        return [self._pool.submit(call, c, i) for i, c in enumerate(self.clients)]

    def _join(self, route: str, futures: list[Future]) -> list[Any]:
        """Wait for every engine's HTTP call; the first failure raises WeightSyncError."""
        deadline = time.monotonic() + self.timeout_s
        results, first_error = [], None
        for url, fut in zip(self.engine_urls, futures):
            try:
                results.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                first_error = first_error or WeightSyncError(
                    f"engine {url}{route}: no answer within {self.timeout_s}s")
            except (EngineError, WeightSyncError) as e:
                first_error = first_error or WeightSyncError(str(e))
            except Exception as e:  # a malformed answer
                first_error = first_error or WeightSyncError(f"engine {url}{route}: {e!r}")
        if first_error is not None:
            raise first_error
        return results

    def release_memory(self) -> None:
        """Shared GPUs: every engine of the cohort frees its memory (weights, KV cache)."""
        route = "/release_memory_occupation"
        self._join(route, self._on_engines(lambda c, i: c.release_memory_occupation()))

    def resume_memory(self) -> None:
        """Shared GPUs: every engine takes its memory back (before weights are sent)."""
        route = "/resume_memory_occupation"
        self._join(route, self._on_engines(lambda c, i: c.resume_memory_occupation()))

    def connect(self) -> None:
        """Form the group: every engine joins over HTTP (threads) while this process is rank 0."""
        if self._pg is not None:
            raise WeightSyncError(f"group {self.group_name!r} is already connected")
        route = "/init_weights_update_group"
        http = self._on_engines(lambda c, i: c.init_weights_update_group(
            self.master_addr, self.master_port, 1 + i * self.ranks_per_engine, self.world_size,
            self.group_name,
            self.backend))
        # rank 0 blocks in the store until every engine joined; run it aside so that an engine
        # refusing (wrong backend, port unreachable) fails the call now, not after timeout_s
        group = self._group_thread.submit(init_weight_update_group, self.master_addr,
                                          self.master_port, 0, self.world_size, self.group_name,
                                          self.backend, self.timeout_s)
        self._poll(f"forming group {self.group_name!r}", group.done, http, route)
        self._pg = group.result()
        try:
            self._join(route, http)
        except WeightSyncError:
            self.close()
            raise
        log.info("weight-sync group %r: rank 0 + %d engines", self.group_name, len(self.clients))

    def send(self, named_tensors: Sequence[tuple[str, torch.Tensor]],
             version: Optional[str | int] = None, flush_cache: bool = True) -> dict[str, Any]:
        """Broadcast every tensor; engines load them and report `version` as weight_version.

        Returns stats: bytes, seconds, num_buckets, broadcasts. Raises WeightSyncError on any failure; the
        group is then unusable (close() this sender, connect a new one on a new port).
        """
        if self._pg is None:
            raise WeightSyncError("send() before connect(): form the group first")
        start = time.monotonic()
        buckets = bucket_named_tensors(list(named_tensors), self.bucket_mb)
        version = None if version is None else str(version)
        try:
            if self.pause_mode is not None:
                self._join("/pause_generation", self._on_engines(
                    lambda c, i: c.pause_generation(self.pause_mode)))
            total = broadcasts = 0
            for b, bucket in enumerate(buckets):
                last = b == len(buckets) - 1
                # the version (and the cache flush) come with the last bucket, once all is in
                nbytes, n = self._send_bucket(bucket, version if last else None,
                                              flush_cache and last)
                total, broadcasts = total + nbytes, broadcasts + n
        except BaseException:
            if self.pause_mode is not None:  # best effort: the original error matters more
                self._on_engines(lambda c, i: c.continue_generation())  # not awaited
            raise
        if self.pause_mode is not None:
            self._join("/continue_generation", self._on_engines(
                lambda c, i: c.continue_generation()))
        stats = {"bytes": total, "seconds": time.monotonic() - start, "num_buckets": len(buckets),
                 "broadcasts": broadcasts}
        log.info("sent %.1f MB in %d buckets (%d broadcasts) in %.2fs (version %s)",
                 total / 2**20, len(buckets), broadcasts, stats["seconds"], version)
        return stats

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: Optional[str],
                     flush_cache: bool) -> tuple[int, int]:
        """(bytes, broadcasts) of one bucket."""
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        route = "/update_weights_from_distributed"
        http = self._on_engines(lambda c, i: c.update_weights_from_distributed(
            names, dtypes, shapes, self.group_name, version, flush_cache, self.load_format))
        # one broadcast per tensor from rank 0, in the order of `names`, all issued async (the
        # engines do the same), then waited for while watching the engines' HTTP answers; or
        # one of the whole bucket flattened
        tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
        if self.load_format is not None:
            tensors = [flatten_bucket(tensors)]
        works = [dist.broadcast(t, src=0, group=self._pg, async_op=True) for t in tensors]
        self._inflight = works
        what = f"broadcasting {len(names)} tensors ({names[0]!r}...) on {self.group_name!r}"
        self._poll(what, lambda: all(w.is_completed() for w in works), http, route)
        self._inflight = []
        try:
            for w in works:
                w.wait()
        except Exception as e:
            raise WeightSyncError(f"{what} failed: {e}") from e
        self._join(route, http)
        return sum(tensor_nbytes(t) for t in tensors), len(tensors)

    def verify(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Compare sha256 per tensor with every engine's GET /weights_checksum (hf engines)."""
        local = [(n, tensor_sha256(t)) for n, t in named_tensors]
        remote = self._join("/weights_checksum",
                            self._on_engines(lambda c, i: c.weights_checksum()))
        for url, sums in zip(self.engine_urls, remote):
            for name, digest in local:
                if sums.get(name) != digest:
                    what = "missing" if name not in sums else "differs"
                    raise WeightSyncError(f"weights of {name!r} on engine {url} {what} "
                                          "(sha256 of the raw bytes)")

    def close(self) -> None:
        """Destroy the group and release the HTTP clients and threads; the sender is done.
        (Engines keep their end of the group until they re-init it or exit.)"""
        if self._inflight and not all(w.is_completed() for w in self._inflight):
            # destroying a group under a pending collective can hang or abort the process
            log.warning("weight-sync group %r left with a broadcast pending; not destroyed, "
                        "its name stays taken in this process", self.group_name)
        else:
            destroy_weight_update_group(self._pg)
        self._pg = None
        self._inflight = []
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._group_thread.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()

    def _poll(self, what: str, is_done: Callable[[], bool], http: list[Future],
              route: str) -> None:
        """Wait until is_done(); fail fast when an engine's HTTP call fails, or at timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0002
        while not is_done():
            for url, fut in zip(self.engine_urls, http):
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise WeightSyncError(f"{what}: engine {url}{route} failed: "
                                          f"{fut.exception()}") from fut.exception()
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{what}: not done within {self.timeout_s}s")
            time.sleep(delay)
            # capped at 1 ms: a sync of small tensors completes in a few ms, and a 20 ms cap
            # added up to 20 ms to each (the tiny model's median sync went 31 -> 21 ms)
            delay = min(2 * delay, 0.001)
