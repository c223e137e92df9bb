"""relax-convert's dispatch: detect the input's format and convert it (dcp -> hf, hf -> dcp,
megatron -> hf; a model.lora run's dcp -> peft or a merged hf). Each direction has its module
(from_dcp.py, from_hf.py, from_megatron.py, from_lora.py);
outputs are written to `OUT.tmp/` and renamed to `OUT/` at the end (outputs.py)."""

from __future__ import annotations

from pathlib import Path

from relax_slurm.checkpoint.formats import detect_format
from relax_slurm.checkpoint.from_dcp import dcp_to_hf
from relax_slurm.checkpoint.from_hf import hf_to_dcp
from relax_slurm.checkpoint.from_lora import dcp_lora_to_hf, dcp_to_peft, lora_record
from relax_slurm.checkpoint.from_megatron import megatron_to_hf
from relax_slurm.checkpoint.hf_files import DEFAULT_SHARD_MB, DTYPES
from relax_slurm.checkpoint.outputs import check_output
from relax_slurm.checkpoint.resume import CheckpointError

def convert_checkpoint(
    input_dir: str | Path, output_dir: str | Path, to: str | None = None,
    dtype: str | None = None, hf_config: str | Path | None = None, progress: bool = False,
    overwrite: bool = False, shard_size_mb: float = DEFAULT_SHARD_MB,
    trust_remote_code: bool = False,
) -> Path:
    """Detect the input's format and convert: dcp -> hf, hf -> dcp, megatron -> hf; a model.lora
    checkpoint (dcp) -> peft (the adapter) or hf (merged)."""
    fmt, src = detect_format(input_dir)
    target = to or ("dcp" if fmt == "hf" else "hf")
    if target == fmt:
        raise CheckpointError(f"--input {src} is already in {fmt} format; --to {target} would "
                              "copy it. Fix: --to " + ("hf" if fmt == "dcp" else "dcp"))
    torch_dtype = None if dtype in (None, "auto") else DTYPES.get(dtype)
    if dtype not in (None, "auto") and torch_dtype is None:
        raise CheckpointError(f"--dtype {dtype}: use auto, {', '.join(DTYPES)}")
    check_output(Path(output_dir), overwrite)  # before the checkpoint is read, not after
    if fmt == "megatron":
        if lora_record(src) is not None:
            raise CheckpointError(
                f"{src} is a trainer=megatron model.lora checkpoint: it holds the adapter "
                "alone in megatron's layout, which relax-convert cannot read yet "
                "(docs/lora.md#status). Fix: the run's merged HF exports "
                "(trainer.save_hf_every), or train with trainer=torch for --to peft")
        if target != "hf":
            raise CheckpointError("a Megatron checkpoint converts to hf only: --to hf")
        return megatron_to_hf(src, output_dir, hf_config, progress, overwrite, torch_dtype)
    if target == "peft" and (fmt != "dcp" or lora_record(src) is None):
        raise CheckpointError(f"--to peft: {src} holds no LoRA adapter (only a model.lora "
                              "run's checkpoints do). Fix: --to hf")
    if fmt == "dcp" and lora_record(src) is not None:
        if target == "peft":
            return dcp_to_peft(src, output_dir, torch_dtype, overwrite)
        return dcp_lora_to_hf(src, output_dir, hf_config, torch_dtype, progress, shard_size_mb,
                              overwrite, trust_remote_code)
    if fmt == "dcp":
        return dcp_to_hf(src, output_dir, hf_config, torch_dtype, progress, shard_size_mb,
                         overwrite, trust_remote_code)
    return hf_to_dcp(src, output_dir, torch_dtype, progress, overwrite, trust_remote_code)
