"""Which format a checkpoint directory holds: our DCP checkpoints, Hugging Face, Megatron
distributed checkpoints, or a run directory (its latest checkpoint)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from relax_slurm.checkpoint.hf_files import hf_weight_files
from relax_slurm.checkpoint.resume import DCP_METADATA, CheckpointError, find_latest

def detect_format(path: str | Path) -> tuple[str, Path]:
    """("dcp" | "hf" | "megatron", the directory to read). A run directory or its checkpoints/
    resolves to its latest complete checkpoint."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"--input {p}: not a directory")
    if p.name.endswith((".tmp", ".del")):
        raise CheckpointError(f"--input {p} is a save that did not finish (or a deletion): "
                              "use a complete step_<N> directory or the run directory")
    mega = _megatron_dir(p)
    if mega is not None:
        return "megatron", mega
    if (p / DCP_METADATA).is_file():
        return "dcp", p
    if (p / "config.json").is_file() and hf_weight_files(p):
        return "hf", p
    latest = find_latest(p)
    if latest is not None:  # a run directory: its newest checkpoint, of either backend
        return ("megatron", latest) if _megatron_dir(latest) is not None else ("dcp", latest)
    raise CheckpointError(
        f"--input {p}: no checkpoint format recognised. Expected a DCP checkpoint (.metadata, "
        "e.g. RUN_DIR/checkpoints/step_<N>), a Hugging Face directory (config.json + "
        "*.safetensors), a Megatron checkpoint (iter_*/ with metadata.json), or a run directory"
    )


def _megatron_dir(p: Path) -> Path | None:
    tracker = p / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = tracker.read_text().strip()
        iter_dir = p / f"iter_{int(it):07d}" if it.isdigit() else p
        return iter_dir if iter_dir.is_dir() else p
    meta = p / "metadata.json"
    if meta.is_file():
        try:
            if "sharded_backend" in json.loads(meta.read_text()):
                return p
        except (ValueError, TypeError):
            pass
    if any(p.glob("mp_rank_*")) and re.fullmatch(r"iter_\d+|release", p.name):
        return p
    return None
