"""Fixtures shared by the unit tests of several packages."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers_broker import Broker, broker_starter

_TESTS = Path(__file__).resolve().parents[1]
for p in (str(_TESTS), str(_TESTS.parent)):  # tests/ for helpers_tiny, the repo for relax_slurm
    if p not in sys.path:
        sys.path.insert(0, p)

from helpers_tiny import make_tiny_model  # noqa: E402


@pytest.fixture
def start_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[Callable[..., Broker]]:
    """Start real broker processes (tests/helpers_broker.py); killed at the test's end."""
    yield from broker_starter(tmp_path, monkeypatch)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 model saved once per session (the engine and worker tests)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"))
