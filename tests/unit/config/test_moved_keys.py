"""Keys that moved (config/moved.py): an old key on the command line or in a config fails
naming the new one; a run directory's config.yaml written with the old keys still loads, and a
resume against it compares key by key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from relax_slurm.config import load_config, save_config, to_train_config
from relax_slurm.config.cluster import SlurmClusterConfig
from relax_slurm.config.load import check_override_keys, schema_keys
from relax_slurm.config.moved import MOVED_KEYS
from relax_slurm.errors import ConfigError
from relax_slurm.launch.compose import compose_config
from relax_slurm.launch.rerun import plan_rerun

REPO = Path(__file__).resolve().parents[3]


def fake_checkpoint(run_dir: Path, step: int) -> None:
    """What find_latest counts as complete: DCP metadata and meta.json."""
    ckpt = run_dir / "checkpoints" / f"step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "saved_unix": 1.0}))


def test_every_new_key_exists_and_no_old_one_does():
    keys = set(schema_keys())
    assert set(MOVED_KEYS.values()) <= keys
    assert not set(MOVED_KEYS) & keys


@pytest.mark.parametrize("old,new", [("cluster.elastic_max_engines", "cluster.elastic.max_engines"),
                                     ("cluster.max_global_restarts", "cluster.restart.max_global"),
                                     ("cluster.container_image", "cluster.container.image")])
def test_old_override_names_the_new_key(old, new):
    with pytest.raises(ConfigError, match=rf"{old} is now {new} .*write {new}=2"):
        check_override_keys(["experiment=tiny_cpu", f"{old}=2"])
    with pytest.raises(ConfigError, match=rf"{old} is now {new}"):
        compose_config(["experiment=tiny_cpu", f"{old}=2"])  # the Python API and --compose


def test_old_key_in_a_composed_config_names_the_new_key():
    cfg = OmegaConf.create({"cluster": {"heartbeat_timeout_s": 30}})
    with pytest.raises(ConfigError, match=r"cluster.heartbeat_timeout_s is now "
                                          r"cluster.restart.heartbeat_timeout_s"):
        to_train_config(cfg)


def old_layout(cfg_yaml: str) -> str:
    """A config.yaml as an older relax-slurm wrote it: one `cluster` section with both
    launchers' keys (a local run's Slurm keys at their defaults), every moved key flat again."""
    tree = OmegaConf.create(cfg_yaml)
    slurm = OmegaConf.structured(SlurmClusterConfig)
    for key in slurm:
        if key not in tree.cluster:
            tree.cluster[key] = slurm[key]
    for key in slurm.elastic:
        tree.cluster.elastic.setdefault(key, slurm.elastic[key])
    for old, new in MOVED_KEYS.items():
        value = OmegaConf.select(tree, new)
        OmegaConf.update(tree, old, value, force_add=True)
    for section in ("restart", "elastic", "container"):
        del tree.cluster[section]
    return OmegaConf.to_yaml(tree)


def test_a_saved_config_with_the_old_keys_loads_and_resumes(tmp_path):
    run = tmp_path / "run"
    cfg = compose_config(["experiment=tiny_cpu", f"run_dir={run}",
                          "cluster.restart.max_global=2", "cluster.elastic.max_engines=3"])
    save_config(cfg, run / "config.yaml")
    text = old_layout((run / "config.yaml").read_text())
    assert "max_global_restarts: 2" in text and "elastic_max_engines: 3" in text
    assert "partition: null" in text and "engine_job_cpus: null" in text
    (run / "config.yaml").write_text(text)
    assert load_config(run / "config.yaml") == cfg
    fake_checkpoint(run, 4)
    again = plan_rerun(cfg, run)  # the old keys are compared at their new places
    assert again.step == 4 and not again.changes
    with pytest.raises(ConfigError, match="trainer.lr 0.002 -> 0.001"):
        plan_rerun(compose_config(["experiment=tiny_cpu", f"run_dir={run}", "trainer.lr=1e-3",
                                   "cluster.restart.max_global=2",
                                   "cluster.elastic.max_engines=3"]), run)


def test_relax_train_says_where_the_key_went(tmp_path):
    r = subprocess.run([sys.executable, "-m", "relax_slurm.launch.cli", "experiment=tiny_cpu",
                        f"run_dir={tmp_path}", "cluster.elastic_max_engines=4"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1, r.stderr
    assert ("cluster.elastic_max_engines is now cluster.elastic.max_engines" in r.stderr), r.stderr


def test_a_saved_local_config_with_a_slurm_key_set_is_refused_naming_it(tmp_path):
    """Only the other cluster's keys at their defaults are dropped from an old config.yaml:
    one set (a hand edit) would be silently ignored, so it is refused like an override."""
    run = tmp_path / "run"
    save_config(compose_config(["experiment=tiny_cpu", f"run_dir={run}"]), run / "config.yaml")
    text = old_layout((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(text.replace("engine_job_cpus: null", "engine_job_cpus: 2"))
    with pytest.raises(ConfigError, match=r"cluster\.elastic\.job_cpus=2: applies to "
                                          r"cluster\.kind=slurm only; run with cluster=slurm"):
        load_config(run / "config.yaml")
