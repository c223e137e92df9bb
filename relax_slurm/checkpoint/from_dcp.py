"""Our DCP checkpoints -> Hugging Face, in one process without a process group: DCP reads any
world size's shards (`dcp.load(..., no_dist=True)` reshards into full tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from relax_slurm.checkpoint.architecture import (
    check_architecture, expected_tensors, load_config, meta_model,
)
from relax_slurm.checkpoint.dcp import MODEL_KEY, quiet_single_process
from relax_slurm.checkpoint.hf_files import DEFAULT_SHARD_MB, write_hf_dir
from relax_slurm.checkpoint.outputs import natural_key, progress_bar
from relax_slurm.checkpoint.resume import META, CheckpointError

READ_CHUNK_BYTES = 1 << 30  # DCP tensors loaded per dcp.load call (bounds the progress step)


def dcp_to_hf(input_dir: str | Path, output_dir: str | Path, hf_config: str | Path | None = None,
              dtype: torch.dtype | None = None, progress: bool = False,
              shard_size_mb: float = DEFAULT_SHARD_MB, overwrite: bool = False,
              trust_remote_code: bool = False) -> Path:
    src = Path(input_dir)
    config_src = hf_config or _dcp_config_source(src)
    config = load_config(config_src, trust_remote_code)
    model = meta_model(config, trust_remote_code)
    expected, aliases = expected_tensors(model)
    metadata = FileSystemReader(src).read_metadata().state_dict_metadata
    stored = {k[len(MODEL_KEY):]: v for k, v in metadata.items()
              if k.startswith(MODEL_KEY) and isinstance(v, TensorStorageMetadata)}
    check_architecture({k: v.size for k, v in stored.items()}, expected, aliases,
                       f"checkpoint {src}", config_src)
    wanted = [k for k in sorted(expected, key=natural_key) if k not in aliases]
    tensors = read_dcp(src, {k: stored[k] for k in wanted}, progress)
    assets = hf_config or (src / "hf" if (src / "hf").is_dir() else config_src)
    return write_hf_dir(tensors, config, output_dir, assets, dtype, model, progress,
                        shard_size_mb, overwrite)


def _dcp_config_source(src: Path) -> str | Path:
    if (src / "hf" / "config.json").is_file():
        return src / "hf"
    try:
        path = json.loads((src / META).read_text())["extra_state"]["config"]["model"]["path"]
        return path
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{src} holds no Hugging Face config (no hf/config.json, no model.path in "
            f"{META}). Fix: pass --hf-config with the model directory the run started from"
        ) from None


def read_dcp(src: Path, items: dict[str, TensorStorageMetadata],
              progress: bool) -> dict[str, torch.Tensor]:
    """Full tensors of `items` (model names), READ_CHUNK_BYTES per dcp.load call."""
    out = {name: torch.empty(md.size, dtype=md.properties.dtype) for name, md in items.items()}
    bar = progress_bar(progress, len(out), "read dcp")
    chunk: dict[str, torch.Tensor] = {}
    nbytes = 0
    for i, (name, t) in enumerate(out.items()):
        chunk[MODEL_KEY + name] = t
        nbytes += t.numel() * t.element_size()
        if nbytes >= READ_CHUNK_BYTES or i == len(out) - 1:
            with quiet_single_process():
                dcp.load(chunk, storage_reader=FileSystemReader(src), no_dist=True)
            bar.update(len(chunk))
            chunk, nbytes = {}, 0
    bar.close()
    return out
