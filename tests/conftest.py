"""Shared fixtures: the tiny model and data, built once per session by the real tools."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """`tools/make_tiny_model.py` + `tools/prepare_data.py` output: DIR/model, DIR/arith_*.jsonl."""
    out = tmp_path_factory.mktemp("tiny")
    for cmd in (["tools/make_tiny_model.py", "--out", str(out / "model")],
                ["tools/prepare_data.py", "--out", str(out)]):
        subprocess.run([sys.executable, *cmd], cwd=REPO, check=True, timeout=120,
                       capture_output=True)
    return out
