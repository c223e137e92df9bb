"""Fixtures shared by the unit tests of several packages."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers_broker import Broker, broker_starter


@pytest.fixture
def start_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[Callable[..., Broker]]:
    """Start real broker processes (tests/helpers_broker.py); killed at the test's end."""
    yield from broker_starter(tmp_path, monkeypatch)
