"""Fixtures for the engine tests: a tiny Qwen3 model saved once per session."""

import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[2]
for p in (str(_TESTS), str(_TESTS.parent)):  # tests/ for helpers_tiny, the repo for relax_slurm
    if p not in sys.path:
        sys.path.insert(0, p)

from helpers_tiny import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"))
