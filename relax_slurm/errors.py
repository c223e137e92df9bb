"""The project's error hierarchy: what a user can cause, with the fix in the message; and the
one check of a map's keys that the wire formats share."""

from __future__ import annotations

from typing import Any, Iterable


class RelaxError(Exception):
    """Base of every error a user can cause or act on."""


class ConfigError(RelaxError):
    """A config key is missing, unknown, of the wrong type or inconsistent with another."""


class DataError(RelaxError):
    """A dataset file, row or key cannot be read; the message names file, row and key."""


class BrokerTimeout(RelaxError):
    """The broker did not answer within the configured timeout."""


class BrokerError(RelaxError):
    """The broker answered with an error."""


class BrokerShutdown(BrokerError):
    """The broker is stopping (the run is ending): a client stops too, quietly."""


class EngineError(RelaxError):
    """An inference engine answered with an error or did not answer in time."""


class EngineUnreachable(EngineError):
    """An engine's connection failed or timed out (it died, restarts or hangs), as opposed to an
    answer with an error: the request may be tried again once the engine is back."""


class EngineAborted(EngineError):
    """An engine ended a generation with finish_reason abort (a weight sync paused it with
    weight_sync.pause_mode=abort, or an abort_all): its tokens are truncated, never trained on
    or scored; the group is generated again."""


class EngineDown(EngineError):
    """An engine did not answer /health within rollout.startup_timeout_s."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


class WeightSyncError(RelaxError):
    """Forming the weight-sync group or broadcasting weights failed or timed out."""


class EngineLost(WeightSyncError):
    """An engine stopped answering during a weight-sync call (it died or hangs), as opposed to
    an answer that is wrong (a checksum mismatch): the cohort re-forms and sends again."""


class RoleFailed(RelaxError):
    """A child process of the run died or hung; the message names the role and its log."""


class RoleHung(RoleFailed):
    """A role stopped heartbeating (or an engine stopped answering /health, or the broker its
    /status) for cluster.restart.heartbeat_timeout_s: alive, maybe, but making no progress."""


class Preempted(RelaxError):
    """The run checkpointed and stopped on request (Slurm's preemption or time-limit signal);
    it resumes from that checkpoint when started again with the same run directory."""


class NodesLost(Preempted):
    """Nodes of the Slurm allocation are down, drained or not responding: the job is requeued
    (like a preemption) and resumes from its latest checkpoint on other nodes."""


def check_map_keys(d: Any, where: str, known: Iterable[str], required: Iterable[str],
                   error: type[Exception], known_hint: str, missing_hint: str = ""
                   ) -> dict[str, Any]:
    """`d` if it is a map whose keys are among `known` and include `required`; else `error`
    naming what is wrong at `where`: not a map, an unknown key (and the known ones, with
    `known_hint`: where they are defined), a missing key (with `missing_hint`)."""
    if not isinstance(d, dict):
        raise error(f"{where}: expected a map, got {type(d).__name__}")
    unknown = sorted(map(str, set(d) - set(known)))
    if unknown:
        raise error(f"{where}: unknown key(s) {unknown}; {known_hint}")
    missing = [k for k in required if k not in d]
    if missing:
        raise error(f"{where}: missing key(s) {missing}{missing_hint}")
    return d
