"""The tiny Qwen3 model of relax_slurm/tiny/model.py (tools/make_tiny_model.py), built once per session (in-process: the
test process has torch and transformers imported already)."""

from __future__ import annotations

from pathlib import Path

import pytest



def make_tiny(out: Path, *extra: str) -> Path:
    from relax_slurm.tiny.model import main

    assert main(["--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("ckpt_tiny") / "model")


@pytest.fixture(scope="session")
def tiny_small_dir(tmp_path_factory) -> Path:
    """Same family, other shapes: a checkpoint of tiny_dir must not load into it."""
    return make_tiny(tmp_path_factory.mktemp("ckpt_tiny_small") / "model",
                     "--hidden-size", "32", "--head-dim", "8")
