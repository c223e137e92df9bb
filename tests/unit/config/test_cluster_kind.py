"""A cluster key the chosen launcher never reads is refused, naming it and the kind it is for."""

from dataclasses import fields, is_dataclass

import pytest

from relax_slurm.config.cluster import LOCAL, SLURM, ClusterConfig
from relax_slurm.errors import ConfigError
from relax_slurm.launch.compose import compose_config

TINY = ["experiment=tiny_cpu", "run_dir=/tmp/relax-unit-run"]


def keys_by_kind(section, prefix="cluster"):
    """{kind or None (both): [dotted key, ...]} from the fields' declarations."""
    out = {}
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            for kind, keys in keys_by_kind(value, f"{prefix}.{f.name}").items():
                out.setdefault(kind, []).extend(keys)
        else:
            out.setdefault(f.metadata.get("only_on"), []).append(f"{prefix}.{f.name}")
    return out


@pytest.mark.parametrize("override", [
    "cluster.partition=gpu", "cluster.trainer_nodes=2", "cluster.gpus_per_node=8",
    "cluster.layout=colocated", "cluster.setup_lines=[module load cuda]",
    "cluster.container.image=img.sqsh", "cluster.elastic.job_cpus=2", "cluster.dry_run=true",
    "cluster.wait=true", "cluster.requeue=false",
])
def test_a_slurm_key_on_a_local_run_is_refused_naming_it(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=.*applies to cluster\.kind=slurm only "
                                          r".*run with cluster=slurm"):
        compose_config([*TINY, override])


def test_a_local_key_on_a_slurm_run_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"cluster\.trainer_cpus=\[0\]: applies to "
                                          r"cluster\.kind=local only"):
        compose_config([*TINY, "cluster=slurm", "cluster.trainer_cpus=[0]"])


def test_every_ignored_key_is_named_at_once():
    """In the order the keys are declared (cluster.container before the allocation's keys)."""
    with pytest.raises(ConfigError, match=r"cluster\.container\.python='python3', "
                                          r"cluster\.account='p1': apply to cluster\.kind=slurm "
                                          r"only \(cluster\.kind=local ignores them\)"):
        compose_config([*TINY, "cluster.account=p1", "cluster.container.python=python3"])


def test_each_kind_takes_its_own_keys_the_shared_ones_and_defaults_written_out():
    local = compose_config([*TINY, "cluster.trainer_cpus=[1]", "cluster.restart.max_global=1",
                            "cluster.elastic.max_engines=4", "cluster.layout=hetjob",
                            "cluster.partition=null"])
    assert local.cluster.trainer_cpus == [1] and local.cluster.elastic.max_engines == 4
    slurm = compose_config([*TINY, "cluster=slurm", "cluster.partition=gpu",
                            "cluster.elastic.job_cpus=2", "cluster.container.image=img.sqsh",
                            "cluster.restart.max_global=1"])
    assert slurm.cluster.partition == "gpu" and slurm.cluster.container.image == "img.sqsh"


def test_the_keys_both_launchers_read_are_these():
    """A new cluster key must be declared for one launcher (`only_on`) or added here: whether
    both launchers really read it is a decision, not a default."""
    kinds = keys_by_kind(ClusterConfig())
    assert sorted(kinds[None]) == [
        "cluster.elastic.drain_timeout_s", "cluster.elastic.max_engines",
        "cluster.elastic.timeout_s", "cluster.kind", "cluster.restart.heartbeat_interval_s",
        "cluster.restart.heartbeat_timeout_s", "cluster.restart.max_global",
        "cluster.restart.max_per_role", "cluster.restart.step_timeout_s"]
    assert sorted(kinds[LOCAL]) == ["cluster.rollout_cpus", "cluster.trainer_cpus"]
    assert "cluster.partition" in kinds[SLURM] and set(kinds) == {None, LOCAL, SLURM}
