"""The HF export of a live training model (bare, DDP or FSDP2), for evaluation or serving."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from relax_slurm.checkpoint.architecture import unwrap_model
from relax_slurm.checkpoint.hf_files import DEFAULT_SHARD_MB, DTYPES, write_hf_dir

def save_hf(model: nn.Module, hf_assets_src: str | Path | None, out_dir: str | Path,
            dtype: torch.dtype | str | None = None,
            shard_size_mb: float = DEFAULT_SHARD_MB) -> Path | None:
    """Export the training model as a Hugging Face directory (for evaluation or serving).

    Call it on every rank: under FSDP2 the full tensors are gathered (a collective); rank 0
    writes `out_dir` atomically (replacing an older export) and gets its path, others get None.
    Works on a bare model, DDP and FSDP2. `hf_assets_src` supplies tokenizer/generation config.
    """
    if isinstance(dtype, str):
        dtype = None if dtype == "auto" else DTYPES[dtype]
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    base = unwrap_model(model)
    owned = {n for n, _ in base.named_parameters()} | {n for n, _ in base.named_buffers()}
    tensors = {k: v for k, v in full.items() if k in owned}
    return write_hf_dir(tensors, base.config, out_dir, hf_assets_src, dtype, base,
                        shard_size_mb=shard_size_mb, overwrite=True)
