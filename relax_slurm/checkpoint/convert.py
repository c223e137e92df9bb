"""relax-convert's dispatch: detect the input's format and convert it (dcp -> hf, hf -> dcp,
megatron -> hf; a model.lora run's checkpoint, of either trainer, -> peft or a merged hf). Each
direction has its module (from_dcp.py, from_hf.py, from_megatron.py, from_lora.py);
outputs are written to `OUT.tmp/` and renamed to `OUT/` at the end (outputs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from relax_slurm.checkpoint.formats import detect_format
from relax_slurm.checkpoint.from_dcp import dcp_to_hf
from relax_slurm.checkpoint.from_hf import hf_to_dcp
from relax_slurm.checkpoint.from_lora import (
    adapter_config, base_model_dir, lora_record, read_adapter, write_merged, write_peft,
)
from relax_slurm.checkpoint.from_megatron import megatron_adapter, megatron_to_hf
from relax_slurm.checkpoint.hf_files import DEFAULT_SHARD_MB, DTYPES
from relax_slurm.checkpoint.outputs import check_output
from relax_slurm.checkpoint.resume import CheckpointError

if TYPE_CHECKING:  # a type hint only
    import torch


def convert_checkpoint(
    input_dir: str | Path, output_dir: str | Path, to: str | None = None,
    dtype: str | None = None, hf_config: str | Path | None = None, progress: bool = False,
    overwrite: bool = False, shard_size_mb: float = DEFAULT_SHARD_MB,
    trust_remote_code: bool = False,
) -> Path:
    """Detect the input's format and convert: dcp -> hf, hf -> dcp, megatron -> hf; a model.lora
    checkpoint (dcp or megatron) -> peft (the adapter) or hf (merged)."""
    fmt, src = detect_format(input_dir)
    target = to or ("dcp" if fmt == "hf" else "hf")
    if target == fmt:
        raise CheckpointError(f"--input {src} is already in {fmt} format; --to {target} would "
                              "copy it. Fix: --to " + ("hf" if fmt == "dcp" else "dcp"))
    torch_dtype = None if dtype in (None, "auto") else DTYPES.get(dtype)
    if dtype not in (None, "auto") and torch_dtype is None:
        raise CheckpointError(f"--dtype {dtype}: use auto, {', '.join(DTYPES)}")
    check_output(Path(output_dir), overwrite)  # before the checkpoint is read, not after
    if fmt != "hf" and lora_record(src) is not None:
        return convert_lora(src, fmt, target, output_dir, hf_config, torch_dtype, progress,
                            overwrite, shard_size_mb, trust_remote_code)
    if target == "peft":
        raise CheckpointError(f"--to peft: {src} holds no LoRA adapter (only a model.lora "
                              "run's checkpoints do). Fix: --to hf")
    if fmt == "megatron":
        if target != "hf":
            raise CheckpointError("a Megatron checkpoint converts to hf only: --to hf")
        return megatron_to_hf(src, output_dir, hf_config, progress, overwrite, torch_dtype)
    if fmt == "dcp":
        return dcp_to_hf(src, output_dir, hf_config, torch_dtype, progress, shard_size_mb,
                         overwrite, trust_remote_code)
    return hf_to_dcp(src, output_dir, torch_dtype, progress, overwrite, trust_remote_code)


def convert_lora(src: Path, fmt: str, target: str, output_dir: str | Path,
                 hf_config: str | Path | None, dtype: torch.dtype | None, progress: bool,
                 overwrite: bool, shard_size_mb: float, trust_remote_code: bool) -> Path:
    """A model.lora checkpoint of either trainer: its adapter under PEFT's saved names (read
    from DCP, or by the megatron backend's reader), written as PEFT's directory or merged into
    its base by the same code whichever trainer made it."""
    if target not in ("peft", "hf"):
        raise CheckpointError(f"{src} is a model.lora checkpoint: it converts to peft (the "
                              "adapter) or hf (merged into its base). Fix: --to peft or --to hf")
    config = adapter_config(src)
    # the base is checked before the adapter is read (a megatron checkpoint builds a model)
    base = base_model_dir(src, config, hf_config) if target == "hf" else None
    tensors = read_adapter(src) if fmt == "dcp" else megatron_adapter(src, hf_config)
    if base is None:
        return write_peft(config, tensors, output_dir, dtype, overwrite)
    return write_merged(src, config, tensors, base, output_dir, dtype, progress, shard_size_mb,
                        overwrite, trust_remote_code)
