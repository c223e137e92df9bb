"""Sections that come in variants (`cluster`: local or slurm): which variant a config is,
which keys each variant has, and the error for a key of the other variant.

A key of one variant does not exist in the other. On the command line it is refused before
Hydra composes (`check_cluster_overrides`, where Hydra would say "Could not override"); in a
preset or YAML file it composes (the variants' schemas take unknown keys, load.open_schema)
and `to_train_config` refuses it: both name it and the cluster it belongs to.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from relax_slurm.config.cluster import CLUSTER_VARIANTS, LOCAL, ClusterConfig
from relax_slurm.config.check import check
from relax_slurm.errors import ConfigError

VARIANTS: dict[type, dict[str, type]] = {ClusterConfig: dict(CLUSTER_VARIANTS)}
"""Base section class -> {kind: variant class}; the root config's field is typed as the base."""


def section_class(cls: type, name: str) -> type | None:
    """The dataclass of field `name` of `cls` (its annotation resolved in the module that
    defines `cls`), or None for a leaf or a dict."""
    sub = typing.get_type_hints(cls)[name]
    return sub if dataclasses.is_dataclass(sub) else None


def variants_of(cls: type) -> list[type]:
    """The classes a section of type `cls` may be: its variants, or `cls` itself."""
    return list(VARIANTS.get(cls, {}).values()) or [cls]


def class_keys(cls: type, prefix: str = "") -> list[str]:
    """Every settable dotted key of `cls` (sections and leaves), variants' keys included."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        sub = section_class(cls, f.name)
        for variant in variants_of(sub) if sub is not None else []:
            out += [k for k in class_keys(variant, f"{prefix}{f.name}.") if k not in out]
    return out


def cluster_kinds(key: str) -> list[str]:
    """The cluster kinds whose schema has dotted `key` (cluster.partition: [slurm])."""
    return [kind for kind in CLUSTER_VARIANTS if key in _cluster_keys(kind)]


@functools.cache
def _cluster_keys(kind: str) -> frozenset[str]:
    # asked for every override and every unknown key: the schema does not change in a process
    return frozenset(class_keys(CLUSTER_VARIANTS[kind], "cluster."))


def cluster_variant(cfg: DictConfig) -> type[ClusterConfig]:
    """The variant of `cfg.cluster`: the schema Hydra composed it from, else (a saved
    config.yaml, plain YAML) the one its `kind` names."""
    node = cfg._get_node("cluster") if "cluster" in cfg else None
    if isinstance(node, DictConfig):
        typ = OmegaConf.get_type(node)
        if typ in CLUSTER_VARIANTS.values():
            return typ  # type: ignore[return-value]
        kind = node.get("kind", LOCAL)
    else:
        kind = LOCAL
    check(kind in CLUSTER_VARIANTS, f"cluster.kind={kind!r}: use local or slurm "
          "(chosen with cluster=local or cluster=slurm)")
    return CLUSTER_VARIANTS[kind]


def wrong_cluster_error(items: Sequence[str], kind: str) -> ConfigError:
    """The error for cluster keys (`items`: 'key' or 'key=value') the `kind` cluster lacks."""
    keys = [i.split("=", 1)[0] for i in items]
    owner = next((k for key in keys for k in cluster_kinds(key)), None)
    one = len(items) == 1
    if owner is None:
        return ConfigError(f"unknown config key(s): {', '.join(items)}; check the spelling "
                           "against `relax-train --cfg job` or docs/configuration.md")
    return ConfigError(
        f"{', '.join(items)}: {'applies' if one else 'apply'} to cluster.kind={owner} only; run "
        f"with cluster={owner} (cluster={kind} has no such key{'' if one else 's'})")


def other_cluster_keys(keys: Sequence[str], kind: str) -> list[str]:
    """Those of dotted `keys` that another cluster variant has and the `kind` one lacks."""
    return [k for k in keys if k.startswith("cluster.") and cluster_kinds(k)
            and kind not in cluster_kinds(k)]


def check_cluster_overrides(overrides: Sequence[str],
                            composed_kind: Callable[[list[str]], str | None]) -> None:
    """ConfigError for `cluster.KEY=value` overrides the chosen cluster lacks, naming them all
    as typed and the cluster they belong to, before anything is composed (validation would
    name a whole section, `cluster.container={...}`, where the override set one key of it).
    The cluster is the last `cluster=NAME`, else `composed_kind(the other overrides)` (an
    experiment preset may choose it; None: unknown, and validation names the keys)."""
    plain = [o for o in overrides if "=" in o and not o.startswith(("-", "+", "~"))]
    specific = [o for o in plain if o.startswith("cluster.")
                and len(cluster_kinds(o.split("=", 1)[0])) == 1]
    if not specific:
        return
    chosen = [o.split("=", 1)[1] for o in plain if o.split("=", 1)[0] == "cluster"]
    if chosen and "," in chosen[-1]:
        return  # a sweep over clusters: each point is checked when it is composed
    kind = chosen[-1] if chosen else composed_kind(
        [o for o in overrides if o not in specific and not o.startswith("-")])
    if kind not in CLUSTER_VARIANTS:
        return
    wrong = [o for o in specific if kind not in cluster_kinds(o.split("=", 1)[0])]
    if wrong:
        raise wrong_cluster_error(wrong, kind)


def drop_unread_defaults(raw: DictConfig) -> list[str]:
    """In a config.yaml saved before `cluster` had variants (every key of both launchers in one
    section), drop the other variants' keys left at their defaults; the keys dropped. A key set
    away from its default stays, and is refused as it would be on the command line."""
    node = raw.get("cluster")
    kind = node.get("kind", LOCAL) if isinstance(node, DictConfig) else None
    if kind not in CLUSTER_VARIANTS:
        return []
    dropped = []
    for other, cls in CLUSTER_VARIANTS.items():
        defaults = OmegaConf.structured(cls)
        for key in other_cluster_keys(class_keys(cls, "cluster.") if other != kind else [],
                                      kind):
            path = key.split(".")[1:]
            parent = OmegaConf.select(node, ".".join(path[:-1])) if path[:-1] else node
            if not isinstance(parent, DictConfig) or path[-1] not in parent:
                continue  # absent, or its section was dropped already
            if _plain(parent[path[-1]]) == _plain(OmegaConf.select(defaults, ".".join(path))):
                del parent[path[-1]]
                dropped.append(key)
    return dropped


def _plain(value: Any) -> Any:
    """A node's value as plain Python, for comparing a saved section with its defaults."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=False)
    return value
