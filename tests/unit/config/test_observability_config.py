"""The observability keys compose from the command line (URLs with ':' and '/' included) and
survive the run directory's config.yaml."""

from pathlib import Path

from hydra import compose, initialize_config_dir

from relax_slurm.config import load_config, register_configs, save_config, to_train_config

CONF = Path(__file__).resolve().parents[3] / "conf"
register_configs()


def test_observability_overrides_compose_and_roundtrip(tmp_path):
    overrides = ["run_dir=/tmp/relax-test-run", "experiment=tiny_cpu", "metrics.tensorboard=true",
                 "metrics.wandb.enabled=true", "metrics.wandb.tags=[a,b]",
                 "notify.urls=[json://127.0.0.1:8123/hook]", "notify.every_steps=5",
                 "debug.dump_rollouts=true", "eval.every=10", "eval.datasets=[/data/test.jsonl]",
                 "eval.n_samples=4", "eval.temperature=0.6"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_train_config(compose("train", overrides=overrides))
    assert cfg.notify.urls == ["json://127.0.0.1:8123/hook"]
    assert cfg.metrics.wandb.tags == ["a", "b"] and cfg.eval.n_samples == 4
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
