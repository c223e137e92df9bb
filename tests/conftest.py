"""Shared fixtures: the tiny model and data, built once per session by the real tools."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Runs that do not test data parallelism train on one rank: on 2 cores a second rank costs ~15
# CPU-s of start-up and ~20% of each step's CPU. The preset's own runs (test_tiny_e2e.py), exact
# resume and the global restart keep its two ranks.
ONE_RANK = "trainer.nproc_per_node=1"
NEEDS_MEGATRON = pytest.mark.skipif(
    importlib.util.find_spec("megatron.bridge") is None,
    reason="megatron-bridge not installed: pip install --no-deps megatron-bridge==0.3.1 "
           "(see docs/backends.md)")
"""The megatron tests' marker: they skip, naming the install command, without the bridge."""


def tiny_command(run_dir: Path, tiny: Path, *overrides: str, experiment: str = "tiny_cpu"
                 ) -> list[str]:
    """`relax-train experiment=tiny_cpu` (or another tiny experiment) on the session's tiny
    model and data."""
    return [sys.executable, "-m", "relax_slurm.launch.cli", f"experiment={experiment}",
            f"run_dir={run_dir}", f"model.path={tiny / 'model'}",
            f"data.train_files=[{tiny / 'arith_train.jsonl'}]", *overrides]


def run_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def relax_train(run_dir: Path, tiny: Path, *overrides: str, timeout_s: float = 900
                ) -> subprocess.CompletedProcess:
    """Run the tiny experiment to its end (the real launcher and process topology)."""
    return subprocess.run(tiny_command(run_dir, tiny, *overrides), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, env=run_env())


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """`tools/make_tiny_model.py` + `tools/prepare_data.py` output: DIR/model, DIR/arith_*.jsonl."""
    out = tmp_path_factory.mktemp("tiny")
    for cmd in (["tools/make_tiny_model.py", "--out", str(out / "model")],
                ["tools/prepare_data.py", "--out", str(out)]):
        # generous: seconds when idle, but a loaded 2-core machine has taken over 120 s
        subprocess.run([sys.executable, *cmd], cwd=REPO, check=True, timeout=600,
                       capture_output=True)
    return out


@pytest.fixture(scope="session")
def tiny_mm_assets(tmp_path_factory) -> Path:
    """The multimodal tiny models and tasks: DIR/vl_model (Qwen2.5-VL), DIR/vl3_model (Qwen3-VL),
    DIR/audio_model
    (Qwen2-Audio), DIR/colors_*.jsonl + DIR/colors/*.png, DIR/change_*.jsonl + DIR/change/*.mp4,
    DIR/tones_*.jsonl + DIR/tones/*.wav."""
    out = tmp_path_factory.mktemp("tiny_mm")
    for cmd in (["tools/make_tiny_model.py", "--out", str(out / "vl_model"), "--kind", "vl"],
                ["tools/make_tiny_model.py", "--out", str(out / "vl3_model"), "--kind", "vl3"],
                ["tools/make_tiny_model.py", "--out", str(out / "audio_model"), "--kind", "audio"],
                ["tools/prepare_mm_data.py", "--out", str(out), "--task", "colors"],
                ["tools/prepare_mm_data.py", "--out", str(out), "--task", "change"],
                ["tools/prepare_mm_data.py", "--out", str(out), "--task", "tones"]):
        subprocess.run([sys.executable, *cmd], cwd=REPO, check=True, timeout=600,
                       capture_output=True)
    return out
