"""`cluster` comes in two variants (config/cluster.py): a key of one does not exist in the other,
and setting it there is refused naming the key and the cluster it belongs to."""

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from relax_slurm.config import load_config, save_config
from relax_slurm.config.cluster import (
    CLUSTER_VARIANTS,
    LOCAL,
    SLURM,
    ElasticConfig,
    LocalClusterConfig,
    SlurmClusterConfig,
    SlurmElasticConfig,
)
from relax_slurm.config.variants import class_keys, cluster_kinds
from relax_slurm.errors import ConfigError
from relax_slurm.launch.compose import compose_config, slurm_overrides

REPO = Path(__file__).resolve().parents[3]
TINY = ["experiment=tiny_cpu", "run_dir=/tmp/relax-unit-run"]


def test_each_variant_is_the_schema_of_its_yaml():
    """Hydra composes conf/cluster/local.yaml onto LocalClusterConfig and slurm.yaml onto
    SlurmClusterConfig (ConfigStore's base_local / base_slurm), and the run gets that type."""
    from hydra import compose, initialize_config_dir

    from relax_slurm.config import register_configs
    from relax_slurm.launch.compose import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for name, cls in (("local", LocalClusterConfig), ("slurm", SlurmClusterConfig)):
            composed = compose("train", overrides=[*TINY, f"cluster={name}"])
            assert OmegaConf.get_type(composed.cluster) is cls
    local = compose_config(TINY).cluster
    assert type(local) is LocalClusterConfig and type(local.elastic) is ElasticConfig
    assert not hasattr(local, "partition") and not hasattr(local.elastic, "job_cpus")
    slurm = compose_config([*TINY, "cluster=slurm"]).cluster
    assert type(slurm) is SlurmClusterConfig and type(slurm.elastic) is SlurmElasticConfig
    assert (slurm.kind, slurm.layout, slurm.signal_lead_s) == ("slurm", "hetjob", 120)
    assert not hasattr(slurm, "trainer_cpus")


@pytest.mark.parametrize("override", [
    "cluster.partition=gpu", "cluster.trainer_nodes=2", "cluster.gpus_per_node=8",
    "cluster.layout=colocated", "cluster.setup_lines=[module load cuda]",
    "cluster.container.image=img.sqsh", "cluster.elastic.job_cpus=2", "cluster.dry_run=true",
    "cluster.wait=true", "cluster.requeue=false", "cluster.partition=null",
])
def test_a_slurm_key_on_a_local_run_is_refused_naming_it(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=.*: applies to cluster\.kind=slurm only; "
                                          r"run with cluster=slurm"):
        compose_config([*TINY, override])


def test_a_local_key_on_a_slurm_run_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"cluster\.trainer_cpus=\[0\]: applies to "
                                          r"cluster\.kind=local only; run with cluster=local"):
        compose_config([*TINY, "cluster=slurm", "cluster.trainer_cpus=[0]"])


def test_every_wrong_key_is_named_at_once():
    with pytest.raises(ConfigError, match=r"cluster\.account=p1, cluster\.container\.python="
                                          r"python3: apply to cluster\.kind=slurm only"):
        compose_config([*TINY, "cluster.account=p1", "cluster.container.python=python3"])


def test_a_preset_choosing_slurm_takes_slurm_keys_without_cluster_slurm():
    """qwen3_4b_dapo chooses cluster=slurm itself: `cluster.partition=gpu` alone is right."""
    cfg = compose_config(["experiment=qwen3_4b_dapo", "run_dir=/tmp/relax-unit-run",
                          "cluster.partition=gpu"])
    assert cfg.cluster.partition == "gpu"  # type: ignore[attr-defined]


def test_added_or_yaml_keys_of_the_other_cluster_are_refused_naming_them(tmp_path):
    """`+cluster.partition=gpu` passes Hydra, and so does a preset (here a user's, through
    --config-dir) setting a Slurm key under cluster=local: both are named like an override."""
    with pytest.raises(ConfigError, match=r"cluster\.partition='gpu': applies to "
                                          r"cluster\.kind=slurm only"):
        compose_config([*TINY, "+cluster.partition=gpu"])
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - tiny_cpu\ncluster:\n  elastic:\n    job_cpus: 2\n")
    r = subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", "--config-dir",
                        str(tmp_path), "experiment=mine", f"run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1, r.stderr
    assert ("cluster.elastic.job_cpus=2: applies to cluster.kind=slurm only; run with "
            "cluster=slurm" in r.stderr), r.stderr
    assert not (tmp_path / "run").exists()


def test_cluster_kind_does_not_switch_the_variant():
    with pytest.raises(ConfigError, match=r"choose the cluster with cluster=slurm"):
        compose_config([*TINY, "cluster.kind=slurm"])


def test_each_kind_takes_its_own_keys_and_the_shared_ones():
    local = compose_config([*TINY, "cluster.trainer_cpus=[1]", "cluster.restart.max_global=1",
                            "cluster.elastic.max_engines=4"])
    assert local.cluster.trainer_cpus == [1] and local.cluster.elastic.max_engines == 4
    slurm = compose_config([*TINY, "cluster=slurm", "cluster.partition=gpu",
                            "cluster.elastic.job_cpus=2", "cluster.container.image=img.sqsh",
                            "cluster.restart.max_global=1"])
    assert slurm.cluster.partition == "gpu" and slurm.cluster.container.image == "img.sqsh"
    assert slurm.cluster.elastic.job_cpus == 2 and slurm.cluster.restart.max_global == 1


def test_a_slurm_override_goes_end_to_end_through_the_loader(tmp_path):
    """`cluster=slurm cluster.partition=x` composed, saved as run_dir/config.yaml and read back
    by a role (load_config): the Slurm variant with the key, both times."""
    cfg = compose_config(slurm_overrides(["experiment=tiny_cpu", "cluster.partition=x",
                                          "cluster.trainer_nodes=2"], str(tmp_path)))
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg and type(again.cluster) is SlurmClusterConfig
    assert again.cluster.partition == "x" and again.cluster.trainer_node_count() == 2
    local = compose_config([*TINY[:1], f"run_dir={tmp_path / 'l'}"])
    save_config(local, tmp_path / "l.yaml")
    assert load_config(tmp_path / "l.yaml") == local
    assert "partition" not in (tmp_path / "l.yaml").read_text()


def test_relax_train_names_a_slurm_key_on_a_local_run(tmp_path):
    """relax-train checks before Hydra, whose own message would be "Could not override"."""
    r = subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", "experiment=tiny_cpu",
                        f"run_dir={tmp_path}", "cluster.partition=gpu"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1, r.stderr
    assert ("cluster.partition=gpu: applies to cluster.kind=slurm only; run with cluster=slurm"
            in r.stderr), r.stderr


def test_the_keys_both_launchers_read_are_these():
    """A new key in the base (ClusterConfig) is read by both launchers: a decision, not a
    default; every other key belongs to one variant."""
    keys = {k for cls in CLUSTER_VARIANTS.values() for k in class_keys(cls, "cluster.")}
    shared = sorted(k for k in keys if len(cluster_kinds(k)) == 2)
    assert shared == [
        "cluster.elastic", "cluster.elastic.drain_timeout_s", "cluster.elastic.max_engines",
        "cluster.elastic.timeout_s", "cluster.kind", "cluster.restart",
        "cluster.restart.heartbeat_interval_s", "cluster.restart.heartbeat_timeout_s",
        "cluster.restart.max_global", "cluster.restart.max_per_role",
        "cluster.restart.step_timeout_s"]
    assert sorted(k for k in keys if cluster_kinds(k) == [LOCAL]) == [
        "cluster.fork_roles", "cluster.rollout_cpus", "cluster.trainer_cpus"]
    slurm = {k for k in keys if cluster_kinds(k) == [SLURM]}
    assert {"cluster.partition", "cluster.container.image", "cluster.elastic.job_cpus"} <= slurm
