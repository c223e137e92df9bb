"""Register the schemas with Hydra, turn a composed config into `TrainConfig`, save and load it.

The launcher composes with Hydra once and writes `run_dir/config.yaml`; every other process
(broker, engines, workers, torchrun ranks) calls `load_config` on that file, so there is one
resolved config per run and no Hydra on the ranks.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.cluster import CLUSTER_VARIANTS, ClusterConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.env import EnvConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.moved import MOVED_KEYS, move_old_keys, moved_message
from relax_slurm.config.reward import RewardConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.config.value_types import type_error
from relax_slurm.config.variants import (
    class_keys,
    cluster_variant,
    drop_unread_defaults,
    other_cluster_keys,
    section_class,
    variants_of,
    wrong_cluster_error,
)
from relax_slurm.errors import ConfigError

NON_SCHEMA_GROUPS = ("experiment", "tuning")
"""Config groups that choose a preset rather than fill a section of TrainConfig."""
# group name -> schema; each group's YAML files list `base_<group>` first in their defaults
# (the cluster group's, `base_local` / `base_slurm`: its variants, CLUSTER_VARIANTS).
GROUP_SCHEMAS = {
    "model": ModelConfig,
    "algo": AlgoConfig,
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "data": DataConfig,
    "reward": RewardConfig,
    "env": EnvConfig,
}


def register_configs() -> None:
    # imported here: every role process loads configs, only the launcher composes them, and
    # importing hydra costs more than a second of each role's start-up
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_train", node=root_schema(ClusterConfig))
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=node)
    for kind, variant in CLUSTER_VARIANTS.items():
        cs.store(group="cluster", name=f"base_{kind}", node=open_schema(variant))


def open_schema(cls: type) -> DictConfig:
    """`cls`'s schema taking keys it lacks: a key of the other cluster (in a preset, a YAML
    file, an override) composes, and `to_train_config` refuses it naming its cluster, where
    Hydra would say "Key 'partition' not in 'LocalClusterConfig'". Types are still checked."""
    node = OmegaConf.structured(cls)

    def unlock(section: DictConfig) -> None:
        OmegaConf.set_struct(section, False)
        for key in section:
            child = section._get_node(key)
            if isinstance(child, DictConfig):
                unlock(child)

    unlock(node)
    return node


def root_schema(cluster: type[ClusterConfig]) -> DictConfig:
    """TrainConfig's schema with `cluster` of type `cluster`. Hydra's root has the base, into
    which either variant merges (OmegaConf merges a subclass into its base, not a sibling)."""
    root = OmegaConf.structured(TrainConfig)
    root.cluster = OmegaConf.structured(cluster)
    return root


def _explain(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    where = f" (key: {key})" if key else ""
    return f"{e.msg if hasattr(e, 'msg') else e}{where}"


def schema_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every settable dotted key of the schema (sections and leaves; both clusters' keys)."""
    return class_keys(cls, prefix)


def check_override_keys(overrides: Sequence[str]) -> None:
    """ConfigError for a `key=value` override whose key the schema lacks, suggesting the closest
    one ("did you mean trainer.total_steps"). Hydra would advise `+key=value`, which then fails
    at validation; group choices (experiment=...), hydra.* and +/~ overrides pass."""
    known = schema_keys()
    for arg in overrides:
        key = arg.split("=", 1)[0]
        if (arg.startswith(("-", "+", "~")) or "=" not in arg or key in NON_SCHEMA_GROUPS
                or key.startswith("hydra.")):
            continue
        if moved_message(key):
            raise ConfigError(f"{moved_message(key)} (in {arg!r}): write "
                              f"{arg.replace(key, MOVED_KEYS[key], 1)}")
        check_key(arg, key, known)


def check_key(arg: str, key: str, known: list[str]) -> None:
    """check_override_keys for one `key=value`: the key walked down the schema (a variant
    section, `cluster`, through every variant's fields), its value type-checked."""
    classes, parts = [TrainConfig], key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: (cls, f) for cls in classes for f in dataclasses.fields(cls)}
        if part not in fields:
            near = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.75)
            close = ([".".join([*parts[:i], near[0], *parts[i + 1:]])] if near else
                     [k for k in known if k.rsplit(".", 1)[-1] == parts[-1]])
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {key!r} (in {arg!r}).{hint} Every key: "
                              "`relax-train experiment=... --cfg job`, docs/configuration.md")
        cls, f = fields[part]
        subs = [sub for c in classes if part in {g.name for g in dataclasses.fields(c)}
                for sub in [section_class(c, part)] if sub is not None]
        if not subs:  # a leaf, or a free-form dict (env.kwargs, data.multimodal_keys)
            if i == len(parts) - 1:
                for value in sweep_items(arg.split("=", 1)[1]):
                    check_value(cls, f, key, value)
            return
        classes = [v for sub in subs for v in variants_of(sub)]


SWEEP_FUNCTIONS = ("range(", "choice(", "interval(", "glob(", "sort(", "shuffle(", "tag(")
"""Hydra's sweep functions: their values are Hydra's to expand (and to check)."""


def sweep_items(value: str) -> list[str]:
    """The values of a `relax-train -m` sweep `a,b,c` (commas outside brackets and quotes),
    one value otherwise; none for Hydra's sweep functions."""
    if value.startswith(SWEEP_FUNCTIONS):
        return []
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(value):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(value[start:i])
            start = i + 1
    return [*items, value[start:]]


def check_value(cls: type, f: dataclasses.Field, key: str, value: str) -> None:
    """ConfigError for a value that cannot be the field's type, naming it with an example."""
    default = f.default if f.default is not dataclasses.MISSING else None
    problem = type_error(key, value, typing.get_type_hints(cls)[f.name], default)
    if problem:
        raise ConfigError(f"{problem}. Every key and its type: `relax-train experiment=... "
                          "--cfg job`, docs/configuration.md")


def _unknown_keys(node: DictConfig, cls: type, prefix: str = "") -> list[str]:
    """Keys in `node` that `cls` has no field for (Hydra lets `+key=...` through)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = []
    for key in node.keys():
        if key == "hydra" and not prefix:
            continue
        if key not in fields:
            unknown.append(f"{prefix}{key}")
            continue
        sub = section_class(cls, key)
        value = node._get_node(key)
        if sub is not None and isinstance(value, DictConfig):
            if sub is ClusterConfig:  # the variant the config is of
                sub = cluster_variant(node)
            unknown += _unknown_keys(value, sub, f"{prefix}{key}.")
    return unknown


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Resolve, type-check and cross-check a composed config."""
    unknown = _unknown_keys(cfg, TrainConfig)
    moved = [m for m in map(moved_message, unknown) if m]
    if moved:
        raise ConfigError(f"moved config key(s): {'; '.join(moved)} (docs/configuration.md)")
    cluster = cluster_variant(cfg)
    kind = cluster().kind
    other = other_cluster_keys(unknown, kind)
    if other:  # `+cluster.partition=gpu` under cluster=local, or a config.yaml edited by hand
        raise wrong_cluster_error(
            [f"{k}={OmegaConf.select(cfg, k, default=None)!r}" for k in other], kind)
    if unknown:
        raise ConfigError(
            f"unknown config key(s): {', '.join(unknown)}; check the spelling against "
            "`relax-train --cfg job` or docs/configuration.md"
        )
    try:
        merged = OmegaConf.merge(root_schema(cluster), cfg)
        OmegaConf.resolve(merged)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config: {_explain(e)}") from e
    assert isinstance(obj, TrainConfig)
    return obj


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    tmp.replace(path)


def load_config(path: str | Path) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file; the launcher writes run_dir/config.yaml")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:
        raise ConfigError(f"{path}: cannot parse YAML: {e}") from e
    if isinstance(raw, DictConfig):
        move_old_keys(raw)  # written by an older relax-slurm (a run resumed or rerun)
        drop_unread_defaults(raw)
    return to_train_config(raw)
