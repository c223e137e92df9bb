"""The broker's reports, typed on both sides: what `get_batch` hands over with its groups
(`BatchStats`, read by the trainer's metrics), what the `stats` request answers (`BrokerStats`,
read by the trainer for its checkpoints' counters) and what the admin HTTP's `GET /status`
answers (`BrokerStatus`, read by the launcher's hang watch and for the run's summary.json, and
by operators: `relax-ctl status`).

The state machine's counters are one type, `Counters`, held by all three. The broker builds a
report and sends `to_dict()` (a msgpack map on ZMQ, JSON over HTTP); a client reads it back with
`from_dict`, which names an unknown or missing key (broker/flat.py, which also keeps the
counters' keys beside the others where the wire always had them so).
Pure: no sockets, no zmq, so the launcher imports it without the broker's server.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from relax_slurm.broker.flat import FLAT, FlatReport, from_flat, to_flat


@dataclass(kw_only=True)
class Counters(FlatReport):
    """The state machine's counters (broker/state.py `BrokerState.counters`)."""

    WHERE = "broker counters"

    version: int
    accepted: int
    dropped: int
    consumed: int
    in_flight: int
    released: int
    queue_depth: int

    @classmethod
    def zero(cls) -> Counters:
        return cls(**dict.fromkeys((f.name for f in fields(cls)), 0))


@dataclass(kw_only=True)
class BatchStats(FlatReport):
    """What `get_batch` hands over with its groups: their samples' staleness (versions behind
    the trainer: the largest, the mean, the count per value) and the counters after the take
    (`counters.dropped`: groups dropped as stale so far); the server adds `auth_refused`
    (requests refused for a wrong secret), the client `wait_s` (how long the request waited;
    both optional on the wire). On the wire the counters' keys stand beside the others."""

    WHERE = "get_batch's stats"

    staleness_max: int
    staleness_mean: float
    staleness_hist: dict[int, int]
    counters: Counters = field(metadata=FLAT)
    auth_refused: int = 0
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        self.staleness_hist = {int(k): int(v) for k, v in self.staleness_hist.items()}

    @classmethod
    def empty(cls) -> BatchStats:
        """No batch: every number 0."""
        return cls(staleness_max=0, staleness_mean=0.0, staleness_hist={},
                   counters=Counters.zero())

    @classmethod
    def merge(cls, parts: list[BatchStats]) -> BatchStats:
        """Several takes of one step as one batch's: staleness over every sample taken, the
        counters as of the last take, the waits summed."""
        if not parts:
            return cls.empty()
        hist: dict[int, int] = {}
        for p in parts:
            for k, v in p.staleness_hist.items():
                hist[k] = hist.get(k, 0) + v
        n = sum(hist.values())
        return replace(parts[-1], staleness_max=max(p.staleness_max for p in parts),
                       staleness_mean=sum(k * v for k, v in hist.items()) / n if n else 0.0,
                       staleness_hist=dict(sorted(hist.items())),
                       wait_s=sum(p.wait_s for p in parts))


@dataclass(kw_only=True)
class BrokerStats(FlatReport):
    """The `stats` request's answer: the counters, the admission budget's terms, the parked
    requests, refused requests and each role's heartbeat age (seconds). On the wire the
    counters' keys stand beside the others (one flat map, as before this type)."""

    WHERE = "the broker's stats"

    counters: Counters = field(metadata=FLAT)
    max_staleness: int
    batch_size: int
    parked_acquires: int
    parked_get_batch: int
    auth_refused: int
    heartbeat_age_s: dict[str, float] = field(default_factory=dict)


# what /status repeats of the counters at its top level (its JSON's keys since the first)
STATUS_TOP_COUNTERS = ("version", "queue_depth", "in_flight")


@dataclass(kw_only=True)
class BrokerStatus:
    """`GET /status`: the run as the broker sees it, one consistent snapshot. `engines` is the
    elastic engine list's view (broker/elastic.py); `roles` per role its heartbeat's age
    (`heartbeat_age_s`) and the info it sent with it. Its JSON holds the counters as a map of
    their own and also repeats their `version`, `queue_depth` and `in_flight` at the top level
    (read from `counters`)."""

    counters: Counters
    max_staleness: int
    batch_size: int
    admission_open: bool
    parked_acquires: int
    parked_get_batch: int
    auth_refused: int
    uptime_s: float
    pid: int
    engines: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        top = {k: getattr(self.counters, k) for k in STATUS_TOP_COUNTERS}
        return {**top, **to_flat(self)}

    @classmethod
    def from_dict(cls, d: Any, where: str = "the broker's /status") -> BrokerStatus:
        return from_flat(cls, d, where, derived=STATUS_TOP_COUNTERS)

    def heartbeat_ages(self) -> dict[str, float]:
        """Seconds since each role's last heartbeat."""
        return {role: float(info.get("heartbeat_age_s", 0.0)) for role, info in self.roles.items()}
