"""Megatron dist-checkpoint (trainer=megatron's step_<N>/) -> Hugging Face directory, through
megatron-bridge, in this one process (TP=PP=1: the dist-checkpoint reshards on load).

The model is built from the HF config kept in the checkpoint (`hf/`, or --hf-config), its
weights are read from the dist-checkpoint, and the bridge's export gives the HF tensors, which
are written by the same writer as the DCP -> HF conversion (safetensors, config, tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import torch

from relax_slurm.checkpoint.hf_files import write_hf_dir
from relax_slurm.checkpoint.resume import CheckpointError
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.megatron import cpu_compat, vl
from relax_slurm.trainer.model import single_process_group
from relax_slurm.trainer.megatron.model import (
    build_provider, destroy_model_parallel, fix_sequential_experts, init_model_parallel,
    mark_tensor_parallel,
)

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dist_checkpoint_to_hf(src: Path, out: Path, hf_config: str | Path | None = None,
                          dtype: torch.dtype | None = None, progress: bool = False,
                          overwrite: bool = False) -> Path:
    from megatron.core import dist_checkpointing
    from transformers import AutoConfig

    config_src = Path(hf_config) if hf_config is not None else Path(src) / "hf"
    if not (config_src / "config.json").is_file() and hf_config is None:
        raise CheckpointError(f"{src} has no hf/config.json: pass --hf-config with the HF model "
                              "(directory or hub id) the run started from")
    config = AutoConfig.from_pretrained(str(config_src))
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    saved = saved if isinstance(saved, torch.dtype) else getattr(torch, str(saved))
    model_cfg = ModelConfig(path=str(config_src), dtype=_NAMES.get(saved, "float32"))
    with single_process_group():
        init_model_parallel(TrainerConfig(backend="megatron", nproc_per_node=1))
        try:
            bridge = cpu_compat.import_bridge().AutoBridge.from_hf_config(config)
            fix_sequential_experts()
            if vl.kind(config) is not None:
                vl.apply()
            provider = build_provider(bridge, model_cfg, TrainerConfig(backend="megatron"),
                                      load_weights=False)
            chunks = provider.provide_distributed_model(
                wrap_with_ddp=False, use_cpu_initialization=cpu_compat.needed(),
                data_parallel_random_init=False, mixed_precision_wrapper=None)
            for c in chunks:
                mark_tensor_parallel(c)
            try:
                state = dist_checkpointing.load({"model": chunks[0].sharded_state_dict()},
                                                str(src))
            except Exception as e:
                raise CheckpointError(
                    f"reading the Megatron checkpoint {src} failed ({e}); it must come from the "
                    f"architecture of {config_src} (pass --hf-config with the right model)"
                ) from e
            chunks[0].load_state_dict(state["model"])
            # AutoBridge.export_hf_weights, given the HF tensor names it orders the export by:
            # without HF weights at hand, the architecture's names on the meta device
            from megatron.bridge.models.conversion import model_bridge

            dispatch = (bridge._causal_lm_architecture, chunks[0])
            tensors = {k: v.clone() for k, v in model_bridge.stream_weights_megatron_to_hf(
                dispatch, chunks, _HFNames(config), cpu=True, show_progress=progress)}
        finally:
            destroy_model_parallel()
    return write_hf_dir(tensors, config, out, config_src, dtype, progress=progress,
                        overwrite=overwrite)


class _HFNames:
    """What the bridge's export reads of a loaded HF model: its config and tensor names."""

    def __init__(self, config) -> None:
        from megatron.bridge.models.hf_pretrained.state import StateDict

        from relax_slurm.checkpoint.architecture import expected_tensors, meta_model
        from relax_slurm.checkpoint.hf_files import revert_weight_conversion

        model = meta_model(config)
        shapes, aliases = expected_tensors(model)
        names = {name: torch.empty(shape, device="meta")
                 for name, shape in shapes.items() if name not in aliases}
        self.config = config
        # the checkpoint-file names (transformers 5 fuses MoE experts in memory; the files and
        # the bridge keep one tensor per expert)
        self.state = StateDict(revert_weight_conversion(model, names))
