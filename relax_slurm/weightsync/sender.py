"""Trainer rank 0's side of weight sync: one group with N engines, buckets of broadcasts.

Protocol (the one SGLang 0.5.21+ servers implement, see docs/weight_sync.md):
  connect: GET /server_info of every engine (its SGLang release must be in SUPPORTED_SGLANG and
           allow weight_sync.pause_mode), then POST /init_weights_update_group to every engine
           (engine i is rank 1+i of a group of 1+N) while rank 0 joins; the HTTP calls return
           once the group has formed.
  send:    [POST /pause_generation {mode}], POST /begin_weight_update; per bucket, POST
           /update_weights_from_distributed {names, dtypes, shapes} to every engine, and
           meanwhile broadcast each tensor of the bucket from rank 0 in the order of `names`
           (or, with load_format=flattened_bucket, the bucket's bytes end to end in one
           broadcast), the HTTP calls returning once the engines loaded the bucket; POST
           /end_weight_update, [POST /continue_generation].
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterable, Optional, Sequence

import httpx
import torch
import torch.distributed as dist

from relax_slurm.errors import EngineError, EngineLost, EngineUnreachable, WeightSyncError
from relax_slurm.engines.client import EngineClient
from relax_slurm.engines.served_adapter import adapter_name, names_present
from relax_slurm.engines.sglang_api import ServerProtocol
from relax_slurm.weightsync.adapter import Adapter, serialize_tensors
from relax_slurm.weightsync.bucket import (FlatBuffer, dtype_name, stream_buckets,
                                           flatten_bucket, tensor_nbytes)
from relax_slurm.weightsync.group import (destroy_weight_update_group, host_store,
                                          init_weight_update_group,
                                          resolve_backend)
from relax_slurm.weightsync.receiver import tensor_sha256

log = logging.getLogger(__name__)


DESTROY_WAIT_S = 30.0
"""How long a replaced cohort's group destruction is waited for (best effort)."""
STALE_SESSION = "already open"
"""SGLang's refusal of a begin while a session is open (words of its message)."""


WAIT_NOTE_S = 1.0
"""How often a sync's wait tells `on_wait` which engines have not finished."""
HEALTH_PROBE_S = 5.0
"""How long a timed-out sync probes each late engine's /model_info to name the one at fault."""


def _answers(client: EngineClient, timeout_s: float) -> bool:
    # not /health: SGLang's generates a token, which waits while the sync has generation paused
    try:
        return client.answers(timeout_s)
    except Exception:  # noqa: BLE001 - any failure to answer is the answer
        return False


def _http_outcome(fut: Future) -> Optional[BaseException]:
    """None while an engine's HTTP call runs or once it succeeded; else what it failed with."""
    if not fut.done():
        return None
    return CancelledError() if fut.cancelled() else fut.exception()


def _cut(err: Optional[BaseException]) -> bool:
    """An engine call that failed on its connection, not by running out its timeout (a waiting
    engine's call times out with the frozen one's)."""
    return (isinstance(err, EngineUnreachable)
            and not isinstance(err.__cause__, httpx.TimeoutException))


def open_session(client: EngineClient) -> None:
    """/begin_weight_update; a session left open by a sync that failed midway is ended first
    (the failing sync sends no end: it could overtake this begin). A session has no owner in
    SGLang, and this trainer is the only one updating."""
    try:
        client.begin_weight_update()
    except EngineError as e:
        if STALE_SESSION not in str(e):
            raise
        log.warning("%s: closing a weight-update session left open", client.url)
        client.end_weight_update()
        client.begin_weight_update()


def load_adapter(client: EngineClient, name: str, config: dict, payload: str,
                 tp_size: int) -> None:
    """Load adapter `name`; one the engine holds already is this version's, loaded by a sync
    that failed after it (a resend carries the same tensors)."""
    try:
        client.load_lora_adapter_from_tensors(name, config, payload, tp_size)
    except EngineError as e:
        if isinstance(e, EngineUnreachable) or not names_present(str(e)):
            raise
        log.info("%s already holds adapter %s (a resend of its version)", client.url, name)


class WeightSender:
    """Push full (gathered, HF-named) tensors from trainer rank 0 to a cohort of engines."""

    def __init__(self, engine_urls: Sequence[str], master_addr: str, master_port: int,
                 group_name: str = "weight_update_group", backend: str = "auto",
                 timeout_s: float = 300.0, bucket_mb: float = 512.0,
                 pause_mode: str = "retract", pause_for_sync: bool = True,
                 ranks_per_engine: int = 1, load_format: Optional[str] = None,
                 adapter_window: int = 1) -> None:
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
        """How engines pause (sglang_api.PAUSE_MODES): around a full send when pause_for_sync
        (an adapter-only sync pauses nothing: `send_adapter`), so
        no batch sees half-updated weights, and before they release memory (SGLang asserts an
        idle engine there). Checked against every engine's protocol at connect."""
        self.pause_for_sync = pause_for_sync
        """False on-policy: nothing generates while weights are sent (the broker admits no
        group of the next version before set_version), and a pause would be two HTTP round
        trips per step for nothing."""
        self.ranks_per_engine = ranks_per_engine
        """Group ranks of one engine: its TP size (SGLang: rank = rank_offset + tp_rank; every
        TP rank receives the full tensor and keeps its shard)."""
        self.load_format = load_format
        """None: one broadcast per tensor; flattened_bucket: one per bucket (bucket.py)."""
        self.adapter_window = adapter_window
        """model.lora's adapter-only sync: how many versions' adapters each engine keeps
        (algo.max_staleness + 1: a request of any version the broker still accepts finds its
        adapter); older ones are unloaded after each sync, in the background."""
        self._unloads: list[Future] = []
        self.world_size = 1 + len(self.engine_urls) * ranks_per_engine
        self.clients = [EngineClient(u, timeout_s) for u in self.engine_urls]
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients),
                                        thread_name_prefix="weight-sync-http")
        self._group_thread = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="weight-sync-group")
        self._pg: Optional[dist.ProcessGroup] = None
        self._issuing: Optional[Future] = None  # the issue of the bucket being sent (its works)
        self.on_wait: Optional[Callable[[list[str]], None]] = None
        """Called during a wait (at most every WAIT_NOTE_S, on the sending thread) with the
        engines that have not answered yet: the trainer's heartbeat says so (stall notes)."""
        self._flat = FlatBuffer() if self.device.type == "cpu" else None
        """flattened_bucket on CPU: the buffer buckets are flattened into, kept across buckets
        and syncs. On GPU the caching allocator reuses memory by itself, and a kept buffer
        would take memory from training between syncs."""

    @property
    def connected(self) -> bool:
        return self._pg is not None

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
                first_error = first_error or EngineLost(
                    f"engine {url}{route}: no answer within {self.timeout_s}s")
            except EngineUnreachable as e:  # its connection failed: died, restarting, hung
                first_error = first_error or EngineLost(str(e))
            except (EngineError, WeightSyncError) as e:
                first_error = first_error or WeightSyncError(str(e))
            except Exception as e:  # a malformed answer
                first_error = first_error or WeightSyncError(f"engine {url}{route}: {e!r}")
        if first_error is not None:
            raise first_error
        return results

    def release_memory(self) -> None:
        """Shared GPUs: every engine of the cohort pauses (SGLang asserts it is idle), then
        frees its memory (weights, KV cache)."""
        self._join("/pause_generation", self._on_engines(
            lambda c, i: c.pause_generation(self.pause_mode)))
        route = "/release_memory_occupation"
        self._join(route, self._on_engines(lambda c, i: c.release_memory_occupation()))

    def resume_memory(self) -> None:
        """Shared GPUs: every engine takes its memory back (before weights are sent) and
        generates again."""
        route = "/resume_memory_occupation"
        self._join(route, self._on_engines(lambda c, i: c.resume_memory_occupation()))
        self._join("/continue_generation", self._on_engines(
            lambda c, i: c.continue_generation()))

    def check_engines(self) -> list[ServerProtocol]:
        """Every engine's protocol (/server_info): an SGLang outside SUPPORTED_SGLANG, or one
        that cannot flush after a pause in `pause_mode`, fails with the reason."""
        protocols = self._join("/server_info", self._on_engines(lambda c, i: c.protocol()))
        for url, p in zip(self.engine_urls, protocols):
            try:
                p.check_pause_mode(self.pause_mode)
            except EngineError as e:
                raise WeightSyncError(f"engine {url}: {e}") from e
        return protocols

    def connect(self) -> None:
        """Form the group: every engine joins over HTTP (threads) while this process is rank 0."""
        if self._pg is not None:
            raise WeightSyncError(f"group {self.group_name!r} is already connected")
        self.check_engines()
        route = "/init_weights_update_group"
        # bound before any engine hears of it: the engines are told the port the store has
        store = host_store(self.master_addr, self.master_port, self.world_size, self.group_name,
                           self.timeout_s)
        self.master_port = store.port
        http = self._on_engines(lambda c, i: c.init_weights_update_group(
            self.master_addr, self.master_port, 1 + i * self.ranks_per_engine, self.world_size,
            self.group_name,
            self.backend))
        # rank 0 blocks in the group's rendezvous until every engine joined; run it aside so that
        # an engine refusing (wrong backend, port unreachable) fails the call now, not after
        # timeout_s
        group = self._group_thread.submit(init_weight_update_group, self.master_addr,
                                          self.master_port, 0, self.world_size, self.group_name,
                                          self.backend, self.timeout_s, store)
        self._poll(f"forming group {self.group_name!r}", group.done, http, route)
        self._pg = group.result()
        try:
            self._join(route, http)
        except WeightSyncError:
            self.close()
            raise
        log.info("weight-sync group %r: rank 0 + %d engines", self.group_name, len(self.clients))

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Adapter,
             version: Optional[str | int] = None, flush_cache: bool = True,
             digests: list | None = None) -> dict[str, Any]:
        """Broadcast every tensor; engines load them and report `version` as weight_version.
        An `Adapter` (model.lora) goes over HTTP instead: `send_adapter`.

        `named_tensors` may be an iterator (an export that gathers each tensor in turn): it is
        read bucket by bucket, one bucket ahead (the last carries the version), so at most two
        buckets per dtype are held. `digests`: a list to append (name, sha256) of every tensor
        sent to, for `verify` without the tensors.

        Returns stats: bytes, seconds, num_buckets, broadcasts. Raises WeightSyncError on any
        failure; the group is then unusable (close() this sender, connect a new one on a new
        port). An iterator is then left where the failure met it: its reader drains it.
        """
        if isinstance(named_tensors, Adapter):
            return self.send_adapter(named_tensors, version)
        if not self.connected:
            raise WeightSyncError("send() before connect(): form the group first")
        start = time.monotonic()
        buckets = stream_buckets(named_tensors, self.bucket_mb)
        version = None if version is None else str(version)
        num_buckets = 0
        try:
            if self.pause_for_sync:
                self._join("/pause_generation", self._on_engines(
                    lambda c, i: c.pause_generation(self.pause_mode)))
            # SGLang refuses updates outside a session, and checks that before it joins the
            # broadcast: the session must be open before rank 0 broadcasts anything
            self._join("/begin_weight_update", self._on_engines(
                lambda c, i: open_session(c)))
            total = broadcasts = 0
            bucket = next(buckets, None)
            while bucket is not None:
                following = next(buckets, None)  # one ahead: is this the last?
                last = following is None
                if digests is not None:
                    digests.extend((n, tensor_sha256(t)) for n, t in bucket)
                # the version (and the cache flush) come with the last bucket, once all is in
                nbytes, n = self._send_bucket(bucket, version if last else None,
                                              flush_cache and last)
                total, broadcasts, num_buckets = total + nbytes, broadcasts + n, num_buckets + 1
                bucket = following
            self._join("/end_weight_update", self._on_engines(
                lambda c, i: c.end_weight_update()))
        except WeightSyncError as e:
            # the engines stay paused: some may hold part of the new weights under the old
            # version's label, and SGLang, continued, would serve them and their samples would
            # pass the staleness check. The resend on the re-formed cohort continues them.
            raise WeightSyncError(
                f"weight sync of version {version} to {len(self.clients)} engine(s) failed: {e}"
                ". The engines stay paused; the trainer re-forms the cohort once every engine "
                "answers again, and resends "
                "(a frozen or dead engine is restarted in place by the launcher); if this "
                "repeats, raise weight_sync.timeout_s or check the named engine's log") from e
        except BaseException:
            # the session a failure leaves open is closed by the next sync's open_session: an
            # end sent from here could overtake that sync's begin and close its session. The
            # engines stay paused, as above: this trainer is going away, its successor resends
            raise
        if self.pause_for_sync:
            self._join("/continue_generation", self._on_engines(
                lambda c, i: c.continue_generation()))
        stats = {"bytes": total, "seconds": time.monotonic() - start, "num_buckets": num_buckets,
                 "broadcasts": broadcasts}
        log.info("sent %.1f MB in %d buckets (%d broadcasts) in %.2fs (version %s)",
                 total / 2**20, num_buckets, broadcasts, stats["seconds"], version)
        return stats

    def send_adapter(self, adapter: Adapter, version: Optional[str | int]) -> dict[str, Any]:
        """The adapter alone, by SGLang's routes: every engine loads it under version
        `version`'s own name (engines/served_adapter.py) beside the versions before it, and
        labels its weights `version` (/update_weight_version: the adapter's own load does not);
        after the sync the version that left the window (`adapter_window`) is unloaded in the
        background. The base weights never change, so the group is not used.

        Nothing is paused: no request ever sees a half-loaded adapter (a request names a
        version's adapter, loaded whole before the engine is labelled with it), so generation
        goes on through the sync. A pause would also hold SGLang's adapter lock: an unload
        waits, holding it, for the requests that use its adapter, a paused request never ends,
        and a load waits on the lock."""
        start = time.monotonic()
        payload = serialize_tensors(adapter.tensors)
        version = 0 if version is None else int(version)
        name = adapter_name(version)
        # the last sync's unloads first: this load would wait on them anyway (the lock), and
        # a failed one is said here
        self._finish_unloads()
        try:
            self._join("/load_lora_adapter_from_tensors", self._on_engines(
                lambda c, i: load_adapter(c, name, adapter.config, payload,
                                          self.ranks_per_engine)))
            self._join("/update_weight_version", self._on_engines(
                lambda c, i: c.update_weight_version(str(version))))
        except WeightSyncError as e:
            raise WeightSyncError(
                f"adapter sync of version {version} to {len(self.clients)} engine(s) failed: "
                f"{e}. The trainer re-forms the cohort once every engine answers again, and "
                "resends") from e
        old = version - self.adapter_window
        if old >= 0:  # an engine that never held it (restarted since) has nothing to unload
            self._unloads = self._on_engines(lambda c, i: c.unload_lora_adapter(
                adapter_name(old)))
        stats = {"bytes": adapter.nbytes, "wire_bytes": len(payload),
                 "seconds": time.monotonic() - start, "num_buckets": 1, "broadcasts": 0}
        log.info("sent the adapter %s (%d tensors, %.3f MB; %.3f MB on the wire) in %.3fs",
                 name, len(adapter.tensors), adapter.nbytes / 2**20, len(payload) / 2**20,
                 stats["seconds"])
        return stats

    def _finish_unloads(self) -> None:
        """Wait for the last sync's unloads (each ends once no request uses its adapter: at most
        a generation). A failed one is logged: it costs the engine memory, not correctness."""
        unloads, self._unloads = self._unloads, []
        for url, fut in zip(self.engine_urls, unloads):
            try:
                fut.result(timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("engine %s/unload_lora_adapter of an old adapter: %s", url, e)

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
            flat = self._flat.flatten(tensors) if self._flat is not None \
                else flatten_bucket(tensors)
            tensors = [flat]
        # issued aside too: NCCL creates its communicator in the first collective, and that
        # call blocks until every rank joined; an engine that failed before joining would hold
        # this thread there, past timeout_s, and the trainer would say nothing (the first GPU
        # run). Here the wait is _poll's: it fails at timeout_s naming the engines.
        pg = self._pg
        issue = self._group_thread.submit(
            lambda: [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors])
        self._issuing = issue
        what = f"broadcasting {len(names)} tensors ({names[0]!r}...) on {self.group_name!r}"

        def done() -> bool:
            if not issue.done():
                return False
            return issue.exception() is not None or all(w.is_completed() for w in issue.result())

        self._poll(what, done, http, route)
        try:
            works = issue.result()
            self._issuing = None
            for w in works:
                w.wait()
        except Exception as e:
            # gloo's own timeout is timeout_s too and may fire before _poll's deadline: name
            # the engines at fault here as well, whichever clock ended the wait
            raise WeightSyncError(f"{what} failed: {self._not_answered(http, route)}; the "
                                  f"broadcast's own error: {e}") from e
        self._join(route, http)
        return sum(tensor_nbytes(t) for t in tensors), len(tensors)

    def verify(self, named_tensors: Sequence[tuple[str, torch.Tensor]] | None = None,
               digests: Sequence[tuple[str, str]] | None = None) -> None:
        """Compare sha256 per tensor with every engine's GET /weights_checksum (hf engines):
        of `named_tensors`, or the `digests` a streamed send recorded."""
        # the engines hash theirs while this process hashes its own (0.8 s each for 448 MB)
        futures = self._on_engines(lambda c, i: c.weights_checksum())
        local = (list(digests) if digests is not None
                 else [(n, tensor_sha256(t)) for n, t in named_tensors])
        remote = self._join("/weights_checksum", futures)
        for url, sums in zip(self.engine_urls, remote):
            for name, digest in local:
                if sums.get(name) != digest:
                    what = "missing" if name not in sums else "differs"
                    raise WeightSyncError(f"weights of {name!r} on engine {url} {what} "
                                          "(sha256 of the raw bytes)")

    def destroy_on_engines(self) -> None:
        """Best effort, before close() when a newer cohort replaced this one: every engine
        still up frees its end of the group (its communicator, and on NCCL its buffers). An
        engine restarted since never had it: its refusal, like any failure here, is logged."""
        route = "/destroy_weights_update_group"
        futures = self._on_engines(lambda c, i: c.destroy_weights_update_group(self.group_name))
        for url, fut in zip(self.engine_urls, futures):
            try:
                fut.result(timeout=min(self.timeout_s, DESTROY_WAIT_S))
            except Exception as e:  # noqa: BLE001 - logged; the new cohort works regardless
                log.info("engine %s%s %r: %s", url, route, self.group_name, e)

    def close(self) -> None:
        """Destroy the group and release the HTTP clients and threads; the sender is done.
        (Engines keep their end of the group until destroy_on_engines(), a re-init or exit.)"""
        issuing = self._issuing
        pending = issuing is not None and (
            not issuing.done() or (issuing.exception() is None
                                   and not all(w.is_completed() for w in issuing.result())))
        if pending:
            # destroying a group under a pending collective can hang or abort the process
            log.warning("weight-sync group %r left with a broadcast pending; not destroyed, "
                        "its name stays taken in this process", self.group_name)
        else:
            destroy_weight_update_group(self._pg)
        self._pg = None
        self._issuing = None
        self._release()

    def _release(self) -> None:
        """The HTTP clients, threads and buffer go: the sender is done."""
        self._flat = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._group_thread.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()

    def _not_answered(self, http: list[Future], route: str) -> str:
        """Which engines (index and URL) did not finish `route`, and why. First those that
        have no answer (none yet, or a connection failure or timeout) and do not answer
        /model_info either: frozen or dead, the likely cause. Then those that answered with
        an error (gloo fails a receive whose peer went away: an engine's error may be another's
        doing), then those that answer HTTP and wait on the broadcast."""
        late, failed = [], []
        for i, (url, fut) in enumerate(zip(self.engine_urls, http)):
            err = _http_outcome(fut)
            if not fut.done() or isinstance(err, EngineUnreachable):
                late.append((i, url, self.clients[i], err))
            elif err is not None:
                failed.append(f"engine {i} ({url}) failed: {err}")
        if not late and not failed:
            return f"every engine answered {route}"
        probe_s = min(HEALTH_PROBE_S, self.timeout_s)
        alive = []
        if late:
            with ThreadPoolExecutor(len(late)) as probes:
                alive = list(probes.map(lambda e: _answers(e[2], probe_s), late))
        silent = [f"engine {i} ({url})" for (i, url, _, _), ok in zip(late, alive) if not ok]
        waiting = [f"engine {i} ({url})" for (i, url, _, err), ok in zip(late, alive)
                   if ok and not _cut(err)]
        # a call whose connection failed (not its timeout) while the engine answers: its own
        # words say more than "waiting"
        cut = [f"engine {i} ({url}) answers HTTP but its {route} call failed: {err}"
               for (i, url, _, err), ok in zip(late, alive) if ok and _cut(err)]
        parts = []
        if silent:
            parts.append(f"{', '.join(silent)} did not receive and does not answer HTTP "
                         f"within {probe_s}s (frozen or dead; see logs/engine<i>.log)")
        parts.extend(failed)
        parts.extend(cut)
        if waiting:
            parts.append(f"{', '.join(waiting)} answer HTTP but did not finish {route} "
                         "(waiting on the broadcast, or unable to join the group)")
        return "; ".join(parts)

    def _poll(self, what: str, is_done: Callable[[], bool], http: list[Future],
              route: str) -> None:
        """Wait until is_done(); fail fast when an engine's HTTP call fails, or at timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0002
        note = time.monotonic() + WAIT_NOTE_S
        while not is_done():
            if self.on_wait is not None and time.monotonic() > note:
                note = time.monotonic() + WAIT_NOTE_S
                self.on_wait([u for u, fut in zip(self.engine_urls, http) if not fut.done()])
            for fut in http:
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    # any engine's failure ends the wait; which one failed first says little:
                    # its HTTP timeout is timeout_s too (a waiting engine's call times out
                    # with the frozen one's), and a receive fails once its peer went away
                    raise WeightSyncError(f"{what}: {self._not_answered(http, route)}") \
                        from fut.exception()
            if time.monotonic() > deadline:
                raise WeightSyncError(f"{what}: not done within weight_sync.timeout_s="
                                      f"{self.timeout_s}s; {self._not_answered(http, route)}")
            time.sleep(delay)
            # capped at 1 ms: a sync of small tensors completes in a few ms, and a 20 ms cap
            # added up to 20 ms to each (the tiny model's median sync went 31 -> 21 ms)
            delay = min(2 * delay, 0.001)
