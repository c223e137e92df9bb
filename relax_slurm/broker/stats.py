"""The broker's reports, typed on both sides: what `get_batch` hands over with its groups
(`BatchStats`, read by the trainer's metrics), what the `stats` request answers (`BrokerStats`,
read by the trainer for its checkpoints' counters) and what the admin HTTP's `GET /status`
answers (`BrokerStatus`, read by the launcher's hang watch and for the run's summary.json, and
by operators: `relax-ctl status`).

The broker builds the dataclass and sends `to_dict()` (a msgpack map on ZMQ, JSON over HTTP: the
same keys as before these types); a client reads it back with `from_dict`, which names an unknown
or missing key, so a key renamed on one side fails where it is read and not as a silent 0.
Pure: no sockets, no zmq, so the launcher imports it without the broker's server.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from relax_slurm.errors import BrokerError


def required_keys(cls: type) -> list[str]:
    """`cls`'s fields without a default."""
    return [f.name for f in fields(cls)
            if f.default is MISSING and f.default_factory is MISSING]


def check_keys(d: Any, where: str, owner: str, names: list[str], required: list[str]
               ) -> dict[str, Any]:
    """`d`'s items if its keys are among `names` and include `required`: BrokerError naming an
    unknown key or a missing one (of `owner`, the type read)."""
    if not isinstance(d, dict):
        raise BrokerError(f"{where}: expected a map, got {type(d).__name__}")
    unknown = sorted(map(str, set(d) - set(names)))
    if unknown:
        raise BrokerError(f"{where}: unknown key(s) {unknown}; {owner} has "
                          f"{sorted(names)} (relax_slurm/broker/stats.py)")
    missing = [k for k in required if k not in d]
    if missing:
        raise BrokerError(f"{where}: missing key(s) {missing} of {owner}")
    return dict(d)


def checked_fields(cls: type, d: Any, where: str, optional: tuple[str, ...] | None = None
                   ) -> dict[str, Any]:
    """`d`'s items if its keys are `cls`'s fields: BrokerError naming an unknown key or a
    missing one (one without a default, or, given `optional`, one not in it)."""
    names = [f.name for f in fields(cls)]
    required = (required_keys(cls) if optional is None
                else [k for k in names if k not in optional])
    return check_keys(d, where, cls.__name__, names, required)


@dataclass(kw_only=True)
class BatchStats:
    """What `get_batch` hands over with its groups: their samples' staleness (versions behind
    the trainer: the largest, the mean, the count per value) and the counters after the take;
    the server adds `auth_refused` (requests refused for a wrong secret), the client `wait_s`
    (how long the request waited). All 0 for no batch."""

    staleness_max: int = 0
    staleness_mean: float = 0.0
    staleness_hist: dict[int, int] = field(default_factory=dict)
    queue_depth: int = 0
    dropped_stale: int = 0
    accepted: int = 0
    consumed: int = 0
    in_flight: int = 0
    auth_refused: int = 0
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        self.staleness_hist = {int(k): int(v) for k, v in self.staleness_hist.items()}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "get_batch's stats") -> BatchStats:
        return cls(**checked_fields(cls, d, where, optional=("auth_refused", "wait_s")))

    @classmethod
    def merge(cls, parts: list[BatchStats]) -> BatchStats:
        """Several takes of one step as one batch's: staleness over every sample taken, the
        counters as of the last take, the waits summed."""
        if not parts:
            return cls()
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
class Counters:
    """The state machine's counters (broker/state.py `BrokerState.counters`)."""

    version: int
    accepted: int
    dropped: int
    consumed: int
    in_flight: int
    released: int
    queue_depth: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "broker counters") -> Counters:
        return cls(**checked_fields(cls, d, where))


COUNTER_KEYS = tuple(f.name for f in fields(Counters))
# what /status repeats of the counters at its top level (its JSON's keys since the first)
STATUS_TOP_COUNTERS = ("version", "queue_depth", "in_flight")


@dataclass(kw_only=True)
class BrokerStats:
    """The `stats` request's answer: the counters, the admission budget's terms, the parked
    requests, refused requests and each role's heartbeat age (seconds). On the wire the
    counters' keys stand beside the others (one flat map, as before this type)."""

    counters: Counters
    max_staleness: int
    batch_size: int
    parked_acquires: int
    parked_get_batch: int
    auth_refused: int
    heartbeat_age_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {**d.pop("counters"), **d}

    @classmethod
    def from_dict(cls, d: Any, where: str = "the broker's stats") -> BrokerStats:
        own = [f.name for f in fields(cls) if f.name != "counters"]
        required = [*COUNTER_KEYS, *(k for k in required_keys(cls) if k != "counters")]
        items = check_keys(d, where, cls.__name__, [*COUNTER_KEYS, *own], required)
        counters = Counters(**{k: items.pop(k) for k in COUNTER_KEYS})
        return cls(counters=counters, **items)


@dataclass(kw_only=True)
class BrokerStatus:
    """`GET /status`: the run as the broker sees it, one consistent snapshot. `engines` is the
    elastic engine list's view (broker/elastic.py); `roles` per role its heartbeat's age
    (`heartbeat_age_s`) and the info it sent with it. Its JSON also repeats the counters'
    `version`, `queue_depth` and `in_flight` at the top level (read from `counters`)."""

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
        return {**top, **asdict(self)}  # (counters too: asdict recurses)

    @classmethod
    def from_dict(cls, d: Any, where: str = "the broker's /status") -> BrokerStatus:
        names = [*STATUS_TOP_COUNTERS, *(f.name for f in fields(cls))]
        items = check_keys(d, where, cls.__name__, names,
                           [*STATUS_TOP_COUNTERS, *required_keys(cls)])
        for k in STATUS_TOP_COUNTERS:  # the same values as in counters
            del items[k]
        items["counters"] = Counters.from_dict(items["counters"], f"{where} counters")
        return cls(**items)

    def heartbeat_ages(self) -> dict[str, float]:
        """Seconds since each role's last heartbeat."""
        return {role: float(info.get("heartbeat_age_s", 0.0)) for role, info in self.roles.items()}
