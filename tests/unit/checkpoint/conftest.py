"""The tiny Qwen3 model of tools/make_tiny_model.py, built once per session (in-process: the
test process has torch and transformers imported already)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def make_tiny(out: Path, *extra: str) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_model",
                                                  REPO / "tools" / "make_tiny_model.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("ckpt_tiny") / "model")


@pytest.fixture(scope="session")
def tiny_small_dir(tmp_path_factory) -> Path:
    """Same family, other shapes: a checkpoint of tiny_dir must not load into it."""
    return make_tiny(tmp_path_factory.mktemp("ckpt_tiny_small") / "model",
                     "--hidden-size", "32", "--head-dim", "8")
