"""Typed reports <-> the maps the broker sends, with nested types kept flat on the wire.

A report is a dataclass; one of its fields may hold another dataclass (the state machine's
`Counters`). Marked `FLAT`, that field's keys stand beside its owner's on the wire (one map, the
format readers scraped before these types); unmarked, it travels as a map of its own under its
name. `to_flat` and `from_flat` do both for any such dataclass, so a report declares only its
fields, and `from_flat` checks every key in one place: an unknown key, or a missing one (a field
without a default), is a BrokerError naming it and the type read, so a key renamed on one side
fails where it is read and not as a silent 0. Pure: no sockets.
"""

from __future__ import annotations

import copy
from dataclasses import MISSING, Field, fields, is_dataclass
from functools import cache
from typing import Any, TypeVar, get_type_hints

from relax_slurm.errors import BrokerError, check_map_keys

T = TypeVar("T")

# a field's metadata: its dataclass's keys stand in its place on the wire
FLAT = {"flat": True}


@cache
def _nested_types(cls: type) -> dict[str, type]:
    """`cls`'s fields that hold a dataclass, and its type (hints resolved once per class:
    the reports' modules use postponed annotations)."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if is_dataclass(hints[f.name])}


def _required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _is_flat(f: Field) -> bool:
    return bool(f.metadata.get("flat"))


@cache
def flat_fields(cls: type) -> dict[str, bool]:
    """`cls`'s keys on the wire, in order, each with whether a map must have it (a field
    without a default); a FLAT field's keys stand in its place, required as in its type."""
    keys: dict[str, bool] = {}
    for f in fields(cls):
        if _is_flat(f):
            keys.update(flat_fields(_nested_types(cls)[f.name]))
        else:
            keys[f.name] = _required(f)
    return keys


def to_flat(obj: Any) -> dict[str, Any]:
    """`obj` (a dataclass) as its wire map: plain values copied (as `asdict` does), FLAT
    fields' keys beside the others, other nested dataclasses as maps of their own."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if _is_flat(f):
            out.update(to_flat(value))
        elif is_dataclass(value):
            out[f.name] = to_flat(value)
        else:
            out[f.name] = copy.deepcopy(value)
    return out


def check_keys(d: Any, where: str, owner: str, keys: dict[str, bool]) -> dict[str, Any]:
    """`d`'s items if it is a map whose keys are among `keys` and include its required ones:
    BrokerError naming an unknown key or a missing one (of `owner`, the type read)."""
    return check_map_keys(d, where, keys, [k for k, required in keys.items() if required],
                          BrokerError, f"{owner} has {sorted(keys)} (relax_slurm/broker/stats.py)",
                          f" of {owner}")


def from_flat(cls: type[T], d: Any, where: str, derived: tuple[str, ...] = ()) -> T:
    """A `cls` from its wire map `d` (`to_flat`'s inverse), every key checked (`check_keys`).
    `derived`: keys the map also carries, repeating values its fields hold (required, not
    read)."""
    keys = {**dict.fromkeys(derived, True), **flat_fields(cls)}
    return _build(cls, check_keys(d, where, cls.__name__, keys), where)


def _build(cls: type[T], items: dict[str, Any], where: str) -> T:
    """A `cls` from checked `items`: a FLAT field from the same items, another nested
    dataclass from its own map."""
    nested = _nested_types(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if _is_flat(f):
            kwargs[f.name] = _build(nested[f.name], items, where)
        elif f.name in nested and f.name in items:
            kwargs[f.name] = from_flat(nested[f.name], items[f.name], f"{where} {f.name}")
        elif f.name in items:
            kwargs[f.name] = items[f.name]
    return cls(**kwargs)


R = TypeVar("R", bound="FlatReport")  # typing.Self is Python 3.11+; setup.cfg allows 3.10


class FlatReport:
    """Base of the broker's reports: `to_dict` and `from_dict` by `to_flat` and `from_flat`,
    so a report declares only its fields (and, as `WHERE`, what its errors call a map)."""

    WHERE = "a broker report"

    def to_dict(self) -> dict[str, Any]:
        return to_flat(self)

    @classmethod
    def from_dict(cls: type[R], d: Any, where: str | None = None) -> R:
        return from_flat(cls, d, where or cls.WHERE)
