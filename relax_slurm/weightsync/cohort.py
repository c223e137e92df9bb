"""The engines' weight-sync cohort as trainer rank 0 keeps it: one group, formed again when an
engine died and came back.

An engine that dies is restarted in place by the launcher (same URL, a new process that loads
model.path and reports weight version 0). Its old group is useless: a broadcast on it fails.
So the cohort is re-formed, all engines together under a new group name (`NAME_c1`, `NAME_c2`,
...) on a new port, and the current weights are sent on it:

- when a send fails (`send`), or an engine stops answering the check after it (`verify`):
  wait until every engine answers again (`rollout.startup_timeout_s`; the engines of the
  failed sync stay paused, so /server_info, not /health), re-form, send again;
- when the broker's engine list changes (elastic rollout, `move`): the cohort becomes the new
  engine set; the trainer sends the weights on it before it reports the engines synced;
- when the broker's engine set changes while a re-forming waits (`follow`: an engine was lost,
  broker/elastic.py, so it will never answer again): the wait goes on with the new set;
- when an engine serves another version than the trainer's while nothing is being sent
  (`resync`, called from the trainer's batch wait): it was restarted meanwhile; re-form and
  send the current weights, so it does not generate with its initial ones. Samples it made in
  between carry its version and are dropped as stale by the broker, never trained on.

Weights given as a stream (an iterator: trainer rank 0 sends an export bucket by bucket as
the ranks gather it, never holding the whole model) cannot be sent twice: after a failed send
or check the stream is read to its end (every rank must finish a gathering export), the
cohort re-forms, and `ResendNeeded` tells the caller to export the weights again.

Once the new cohort has formed, the engines destroy the old group
(/destroy_weights_update_group), so a long run's replaced cohorts do not pile up on them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from relax_slurm.errors import EngineLost, EngineUnreachable, WeightSyncError
from relax_slurm.engines.client import EngineClient, wait_until_healthy
from relax_slurm.weightsync.sender import WeightSender

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 5.0

MakeSender = Callable[[str, int, list[str]], WeightSender]
"""(group name, port, engine URLs) -> an unconnected sender to those engines."""


class _EnginesChanged(Exception):
    """The broker's engine set changed during a re-forming's wait (internal)."""


class ResendNeeded(WeightSyncError):
    """A streamed send, or its check, failed and the cohort has re-formed: the stream is
    spent, so the weights must be exported again (by every rank, where that gathers)."""


def _spent(weights) -> bool:
    """Read a stream to its end (the rest of a gathering export runs on every rank in step);
    True if `weights` was one."""
    if not isinstance(weights, Iterator):
        return False
    for _ in weights:
        pass
    return True


class Cohort:
    def __init__(self, urls: Sequence[str], group_name: str, port: int, make_sender: MakeSender,
                 new_port: Callable[[], int], startup_timeout_s: float,
                 waiting: Callable[[], None] = lambda: None,
                 follow: Callable[[], Sequence[str] | None] = lambda: None) -> None:
        """`waiting` runs between the health polls of a re-forming (the trainer heartbeats
        there: waiting for a restarting engine is not a hang); `follow` then gives the
        broker's cohort (None: not asked this time, or no answer)."""
        self.urls = list(urls)
        self.waiting = waiting
        self.follow = follow
        self.group_name = group_name
        self.make_sender = make_sender
        self.new_port = new_port
        self.startup_timeout_s = startup_timeout_s
        self.generation = 0
        self.sender = make_sender(group_name, port, self.urls)

    def connect(self) -> None:
        self.sender.connect()

    def send(self, weights, version: int, digests: list | None = None) -> dict:
        """`weights`: a list (or an Adapter), or a stream (an iterator, see above);
        `digests`: a list the send appends each tensor's sha256 to, for `verify`."""
        try:
            return self.sender.send(weights, version=version, digests=digests)
        except WeightSyncError as e:
            log.warning("weight sync failed (%s); waiting for every engine, then a new cohort",
                        str(e).splitlines()[0])
            spent = _spent(weights)
        self.reform()
        if spent:
            raise ResendNeeded(f"the weights of version {version} were a stream: export them "
                               "again for the new cohort")
        return self.sender.send(weights, version=version, digests=digests)

    def verify(self, weights, version: int, digests: list | None = None) -> None:
        """Compare every engine's weights with `weights` (or, for a stream, the `digests` its
        send recorded) bit for bit (weight_sync.verify). An engine lost meanwhile (it died
        right after the send, or was restarted) is waited for like a failed send: re-form,
        send, verify again. A mismatch raises WeightSyncError."""
        stream = isinstance(weights, Iterator)
        try:
            self.sender.verify(None if stream else weights, digests if stream else None)
            return
        except WeightSyncError as e:
            # a mismatch with every engine up at this version is real; an engine that stopped
            # answering, or was restarted since the send (it serves another version), is not
            if not isinstance(e, EngineLost) and self.stale(version) == []:
                raise
            log.warning("weight check failed (%s); waiting for every engine, then a new cohort",
                        str(e).splitlines()[0])
        self.reform()
        if stream:
            raise ResendNeeded(f"the weights of version {version} were a stream: export them "
                               "again for the new cohort")
        self.sender.send(weights, version=version)
        self.sender.verify(weights)

    def stale(self, version: int) -> list[str] | None:
        """Engines serving another version than `version`; None while one does not answer
        (it is being restarted: try again later). Any other error (a server without
        /model_info, say) is raised: taking it for "unknown" would never re-sync the engine."""
        out = []
        for url in self.urls:
            try:
                with EngineClient(url, PROBE_TIMEOUT_S) as client:
                    served = client.weight_version()
            except EngineUnreachable:
                return None
            if served != str(version):
                out.append(url)
        return out

    def resync(self, weights: Callable[[], list], version: int) -> bool:
        """Re-form and send `weights()` if an engine lost them (see above); True if it did."""
        stale = self.stale(version)
        if not stale:
            return False
        log.warning("engine(s) %s serve another version than %d (restarted?): re-forming the "
                    "weight-sync cohort", stale, version)
        self.reform()
        self.sender.send(weights(), version=version)
        return True

    def reform(self) -> None:
        while True:
            try:
                # paused_ok: the engines of a failed sync stay paused until the resend
                wait_until_healthy(self.urls, self.startup_timeout_s,
                                   between_polls=self._between_polls, paused_ok=True)
                break
            except _EnginesChanged:
                continue  # wait for the new set (a lost engine would never answer)
        old = self.sender
        self.generation += 1
        name = f"{self.group_name}_c{self.generation}"
        self.sender = self.make_sender(name, self.new_port(), self.urls)
        try:
            self.sender.connect()
            log.info("weight-sync cohort %d formed (%s, %d engines)", self.generation, name,
                     len(self.urls))
            # once the new group formed: an engine still in a receive the old sender gave up
            # drops it then (weightsync/receiver.py), so the old group is idle when destroyed
            old.destroy_on_engines()
        finally:
            old.close()

    def _between_polls(self) -> None:
        self.waiting()
        urls = self.follow()
        if urls and list(urls) != self.urls:
            log.warning("weight-sync cohort: the broker's engine set changed while waiting for "
                        "the engines: %s -> %s", self.urls, list(urls))
            self.urls = list(urls)
            raise _EnginesChanged

    def move(self, urls: Sequence[str]) -> None:
        """Elastic rollout: the cohort is these engines from now on (engines joined or left,
        see broker/elastic.py); re-formed at once, the caller sends the weights next."""
        log.info("weight-sync cohort: engines %s -> %s", self.urls, list(urls))
        self.urls = list(urls)
        self.reform()

    def close(self) -> None:
        self.sender.close()
