"""A run whose trainer would send a tensor the engines' checkpoint does not hold stops at its
first weight sync, naming it (weightsync/names.py): SGLang would skip the name and serve the
old tensor under every new version, and the run would train off-policy without a word."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import ONE_RANK, relax_train

RENAMED = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_name_the_checkpoint_lacks_stops_the_run_at_its_first_sync(tiny_assets, tmp_path):
    # a checkpoint written under other names than the model's (here one tensor, renamed):
    # transformers and the hf engine load it with that tensor newly initialized, and the
    # trainer's name for it is not the file's
    assets = tmp_path / "assets"
    shutil.copytree(tiny_assets, assets)
    weights = assets / "model" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.layers.0.mlp.down_proj.weights"] = tensors.pop(RENAMED)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    run_dir = tmp_path / "run"
    proc = relax_train(run_dir, assets, ONE_RANK, "trainer.total_steps=3", timeout_s=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"ConfigError: weight sync: the trainer sends '{RENAMED}'" in log, log[-3000:]
    assert "(the files hold e.g. 'model.layers.1.mlp.down_proj.weight')" in log, log[-3000:]
    # stopped at the first sync: no step was logged as done
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip(), metrics.read_text()
