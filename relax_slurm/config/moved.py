"""Config keys that moved: an old key on the command line fails naming its new place, and a
saved config (run_dir/config.yaml of an older relax-slurm, read back on resume) is read with
its old keys moved to their new places.

Session 14 (issue #24, "config as variants") split the flat `cluster` section into
`cluster.restart`, `cluster.elastic` and `cluster.container`.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

MOVED_KEYS = {
    "cluster.max_global_restarts": "cluster.restart.max_global",
    "cluster.max_role_restarts": "cluster.restart.max_per_role",
    "cluster.heartbeat_interval_s": "cluster.restart.heartbeat_interval_s",
    "cluster.heartbeat_timeout_s": "cluster.restart.heartbeat_timeout_s",
    "cluster.step_timeout_s": "cluster.restart.step_timeout_s",
    "cluster.elastic_timeout_s": "cluster.elastic.timeout_s",
    "cluster.elastic_drain_timeout_s": "cluster.elastic.drain_timeout_s",
    "cluster.elastic_max_engines": "cluster.elastic.max_engines",
    "cluster.engine_job_partition": "cluster.elastic.job_partition",
    "cluster.engine_job_cpus": "cluster.elastic.job_cpus",
    "cluster.engine_job_gpus": "cluster.elastic.job_gpus",
    "cluster.engine_job_time_min": "cluster.elastic.job_time_min",
    "cluster.engine_job_mem_gb": "cluster.elastic.job_mem_gb",
    "cluster.container_image": "cluster.container.image",
    "cluster.container_mounts": "cluster.container.mounts",
    "cluster.container_prefix": "cluster.container.prefix",
    "cluster.container_python": "cluster.container.python",
}
"""Old dotted key -> new dotted key."""


def moved_message(key: str) -> str | None:
    """'cluster.elastic_max_engines is now cluster.elastic.max_engines', or None."""
    new = MOVED_KEYS.get(key)
    return f"{key} is now {new}" if new else None


def move_old_keys(cfg: DictConfig) -> list[str]:
    """Move every old key present in `cfg` to its new place (in place); the moves made, as
    'old -> new'. A key set at both places keeps the new one's value."""
    moves = []
    for old, new in MOVED_KEYS.items():
        section, _, leaf = old.rpartition(".")
        node = OmegaConf.select(cfg, section)
        if not isinstance(node, DictConfig) or leaf not in node:
            continue
        value: Any = node[leaf]
        del node[leaf]
        if OmegaConf.select(cfg, new, default=None) is None:
            OmegaConf.update(cfg, new, value, force_add=True)
        moves.append(f"{old} -> {new}")
    return moves
