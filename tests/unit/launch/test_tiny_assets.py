"""A tiny preset on a fresh machine builds its model and data on first use (the tools' own
code, in the launcher's process), says so once per asset, and leaves everything else alone."""

from __future__ import annotations

import json

import pytest

from relax_slurm.launch.submit import compose_config
from relax_slurm.tiny.assets import ensure_tiny_assets, missing_tiny_assets

pytestmark = pytest.mark.timeout(300)


def test_a_tiny_preset_builds_what_it_names_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["experiment=tiny_cpu", "run_dir=r"])
    assert [str(p) for p, _ in missing_tiny_assets(cfg)] == ["tiny/model",
                                                             "tiny/arith_train.jsonl"]
    said: list[str] = []
    assert ensure_tiny_assets(cfg, said.append) == 2
    assert len(said) == 2 and "tiny/model does not exist yet: building it" in said[0]
    assert json.loads((tmp_path / "tiny/model/config.json").read_text())["model_type"] == "qwen3"
    rows = (tmp_path / "tiny/arith_train.jsonl").read_text().splitlines()
    assert len(rows) == 5000 and (tmp_path / "tiny/arith_test.jsonl").is_file()
    assert ensure_tiny_assets(cfg, said.append) == 0 and len(said) == 2  # built once


def test_paths_that_are_not_the_presets_are_left_to_the_input_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["experiment=tiny_cpu", "run_dir=r", "model.path=mine/model",
                          "data.train_files=[tiny/typo_train.jsonl]"])
    assert missing_tiny_assets(cfg) == []
