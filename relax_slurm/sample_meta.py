"""The typed contract of `Sample.metadata`: the keys the rollout worker stamps on each sample and
the broker and trainer read.

On the wire (broker/wire.py) and in the broker's spill file the metadata stays a msgpack map
with string keys, as before; `SampleMeta` is how every role builds and reads it, so a key cannot
be misspelt on one side only: the worker builds a `SampleMeta` (a misspelt field is a
TypeError) and writes `to_dict()`; the broker and the trainer read `SampleMeta.of(sample)`,
which names an unknown or missing key, or a value of the wrong type, in its error.

    key              set by                                  read by
    worker           every mode: the worker's rank           broker and trainer (data positions)
    data_state       every mode: the dataset position after  broker and trainer (data positions:
                     the group's prompt (None: the proxy)    data_position.py)
    reward_errors    every mode: rewards that failed         trainer metrics
    filtered_groups  every mode: groups dynamic sampling     trainer metrics
                     dropped since the last group sent
    t_start, t_end   every mode: the group's generation      trainer metrics (perf/gen_time_s)
    t_scored         single-turn and env episodes: when the  trainer metrics
                     group's rewards (and teacher log-probs) (perf/score_time_s)
                     were in
    turns            multi-turn: model turns of the episode  trainer metrics
    episode_end      multi-turn: why the episode ended       trainer metrics
    agent_group      agent proxy: the group's name           (logs, rollout dumps)
    resumed          sequences continued from an aborted     rollout/resumed_frac
                     prefix (pause_mode=abort)

A sample with empty metadata (`{}`) was stamped by no worker (test fixtures, the SFT trainer's
rows): `SampleMeta.of` gives None, and it carries no data position.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from relax_slurm.errors import check_map_keys

# per key: the types its value may have (bool is refused where an int is expected)
_TYPES: dict[str, tuple[type, ...]] = {
    "worker": (int,), "data_state": (dict, type(None)), "reward_errors": (int,),
    "filtered_groups": (int,), "t_start": (int, float, type(None)),
    "t_end": (int, float, type(None)), "t_scored": (int, float, type(None)),
    "turns": (int, type(None)),
    "episode_end": (str, type(None)), "agent_group": (str, type(None)), "resumed": (int, type(None)),
}
_REQUIRED = ("worker",)
# written even when None (a proxy's data_state None still marks a data position)
_ALWAYS = ("worker", "data_state", "reward_errors", "filtered_groups")


class MetadataError(ValueError):
    """Sample metadata that breaks the contract: names the key."""


@dataclass(kw_only=True)
class SampleMeta:
    """What a rollout worker stamps on each sample of a group (see the module docstring)."""

    worker: int
    data_state: dict[str, Any] | None = None
    reward_errors: int = 0
    filtered_groups: int = 0
    t_start: float | None = None
    t_end: float | None = None
    t_scored: float | None = None
    """When the group's rewards (and a teacher's log-probs) were in: t_scored - t_end is what
    scoring took after generation (`perf/score_time_s`)."""
    turns: int | None = None
    episode_end: str | None = None
    agent_group: str | None = None
    resumed: int | None = None
    """Sequences of the group continued from the prefix a sync's abort left
    (weight_sync.pause_mode=abort, rollout/partial.py): `rollout/resumed_frac`."""

    def __post_init__(self) -> None:
        # vars, not asdict (which deep-copies data_state): this runs for every sample the
        # broker accepts and the trainer reads
        for key, value in vars(self).items():
            _check_type(key, value, "SampleMeta")

    def to_dict(self) -> dict[str, Any]:
        """The wire form: a msgpack map; optional keys left at None are not written. Shallow
        (vars, not asdict): a worker writes it for each of a step's samples, and asdict's deep
        copy of data_state was a third of its work after generation (the map is encoded, never
        changed)."""
        return {k: v for k, v in vars(self).items() if v is not None or k in _ALWAYS}

    @classmethod
    def from_dict(cls, meta: dict[str, Any], where: str = "sample metadata") -> SampleMeta:
        """Inverse of `to_dict`; MetadataError naming an unknown or missing key or a value of
        the wrong type."""
        check_map_keys(meta, where, _TYPES, _REQUIRED, MetadataError,
                       f"the keys are {sorted(_TYPES)} (relax_slurm/sample_meta.py)",
                       " (every rollout worker stamps them)")
        try:  # __post_init__ checks each value's type
            return cls(**meta)
        except MetadataError as e:
            raise MetadataError(str(e).replace("SampleMeta", where, 1)) from None

    @classmethod
    def of(cls, sample: Any) -> SampleMeta | None:
        """The sample's metadata, or None when no worker stamped it (empty)."""
        if not sample.metadata:
            return None
        return cls.from_dict(sample.metadata, f"sample {sample.prompt_id}/{sample.group_id} "
                                              "metadata")


def metas_of(samples: Iterable[Any]) -> list[SampleMeta | None]:
    """`SampleMeta.of` of each sample, parsed once per run of equal maps: a group's samples
    carry equal maps (one worker's stamp), and parsing 512 of them was ~5 ms of a tiny
    step's trainer and broker alike."""
    out: list[SampleMeta | None] = []
    last_map: Any = None
    for s in samples:
        if not out or s.metadata != last_map:
            meta, last_map = SampleMeta.of(s), s.metadata
        out.append(meta)
    return out


def _check_type(key: str, value: Any, where: str) -> None:
    types = _TYPES[key]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise MetadataError(f"{where}: key {key!r} must be {names}, got {value!r}")

