"""Hugging Face -> a weights-only DCP checkpoint, loadable by `load_checkpoint` (resume=PATH) on
any world size."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from relax_slurm.checkpoint.architecture import (
    check_architecture, expected_tensors, load_config, meta_model, tied_sources,
)
from relax_slurm.checkpoint.dcp import MODEL_KEY, meta_dict, quiet_single_process
from relax_slurm.checkpoint.hf_files import copy_hf_assets, read_hf, set_config_dtype
from relax_slurm.checkpoint.outputs import finish_output, start_output
from relax_slurm.checkpoint.resume import META

def hf_to_dcp(input_dir: str | Path, output_dir: str | Path, dtype: torch.dtype | None = None,
              progress: bool = False, overwrite: bool = False,
              trust_remote_code: bool = False) -> Path:
    """A weights-only checkpoint, loadable by `load_checkpoint` (resume=PATH) on any world size."""
    src, out = Path(input_dir), Path(output_dir).resolve()
    config = load_config(src, trust_remote_code)
    model = meta_model(config, trust_remote_code)
    expected, aliases = expected_tensors(model)
    tensors = read_hf(src, progress)
    for alias in aliases & set(tensors):  # some checkpoints store tied copies: the source wins
        del tensors[alias]
    check_architecture({k: v.shape for k, v in tensors.items()}, expected, aliases,
                       f"Hugging Face weights in {src}", src / "config.json",
                       fix="repair config.json or the weight files; they must describe one model")
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        set_config_dtype(config, dtype)
    # the trainer's state dict names tied weights twice (same tensor): so does this checkpoint
    model_sd = dict(tensors)
    model_sd.update({alias: tensors[source] for alias, source in
                     tied_sources(model, aliases).items()})
    tmp = start_output(out, overwrite)
    with quiet_single_process():
        dcp.save({MODEL_KEY[:-1]: model_sd}, storage_writer=FileSystemWriter(tmp, overwrite=True),
                 no_dist=True)
    (tmp / "hf").mkdir()
    config.save_pretrained(tmp / "hf")
    copy_hf_assets(src, tmp / "hf", include_config=False)
    meta = meta_dict(0, {"source": str(src.resolve())}, weights_only=True)
    meta["world_size"] = 1
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    return finish_output(tmp, out)
