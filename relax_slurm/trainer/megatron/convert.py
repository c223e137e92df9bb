"""Megatron dist-checkpoint (trainer=megatron's step_<N>/) -> Hugging Face directory, through
megatron-bridge, in this one process (TP=PP=1: the dist-checkpoint reshards on load).

The model is built from the HF config kept in the checkpoint (`hf/`, or --hf-config), its
weights are read from the dist-checkpoint, and the bridge's export gives the HF tensors, which
are written by the same writer as the DCP -> HF conversion (safetensors, config, tokenizer).
A model.lora checkpoint's adapter is read on the same model (`dist_checkpoint_adapter`), for
relax-convert's PEFT writer and merge (checkpoint/from_lora.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from relax_slurm.checkpoint.from_lora import lora_record
from relax_slurm.checkpoint.hf_files import write_hf_dir
from relax_slurm.checkpoint.resume import CheckpointError
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.megatron import bridges, cpu_compat, lora, omni, vl
from relax_slurm.trainer.megatron.checkpoint import load_model_state, model_sharded_state_dict
from relax_slurm.trainer.model import single_process_group
from relax_slurm.trainer.megatron.model import (
    build_provider, destroy_model_parallel, fix_sequential_experts, init_model_parallel,
    mark_tensor_parallel,
)

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@contextmanager
def bare_model(src: Path, hf_config: str | Path | None = None
               ) -> Iterator[tuple[Any, list, Any, Path]]:
    """(bridge, model chunks, HF config, its directory): the checkpoint's architecture built
    without weights in a one-rank process group (TP=PP=1), torn down on exit."""
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
            bridge_mod = cpu_compat.import_bridge()
            bridges.register()  # before the bridge validates Qwen3-Omni's, Qwen2-Audio's
            bridge = bridge_mod.AutoBridge.from_hf_config(config)
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
            yield bridge, chunks, config, config_src
        finally:
            destroy_model_parallel()


def load_dist_state(src: Path, sharded: dict, config_src: Path) -> dict:
    """dist_checkpointing.load, resharded to this one rank; CheckpointError naming the fix."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(sharded, str(src))
    except Exception as e:
        raise CheckpointError(
            f"reading the Megatron checkpoint {src} failed ({e}); it must come from the "
            f"architecture of {config_src} (pass --hf-config with the right model)"
        ) from e


def dist_checkpoint_to_hf(src: Path, out: Path, hf_config: str | Path | None = None,
                          dtype: torch.dtype | None = None, progress: bool = False,
                          overwrite: bool = False) -> Path:
    with bare_model(src, hf_config) as (bridge, chunks, config, config_src):
        state = load_dist_state(src, {"model": chunks[0].sharded_state_dict()}, config_src)
        chunks[0].load_state_dict(state["model"])
        # AutoBridge.export_hf_weights, given the HF tensor names it orders the export by:
        # without HF weights at hand, the architecture's names on the meta device
        from megatron.bridge.models.conversion import model_bridge

        dispatch = (bridge._causal_lm_architecture, chunks[0])
        tensors = {k: v.clone() for k, v in model_bridge.stream_weights_megatron_to_hf(
            dispatch, chunks, _HFNames(config), cpu=True, show_progress=progress)}
    return write_hf_dir(tensors, omni.thinker_only_config(config), out, config_src, dtype,
                        progress=progress, overwrite=overwrite)


def dist_checkpoint_adapter(src: Path, hf_config: str | Path | None = None
                            ) -> dict[str, torch.Tensor]:
    """{PEFT saved name: full tensor} of a model.lora checkpoint (registered in setup.cfg under
    relax_slurm.checkpoint_adapter_readers, read by checkpoint/from_megatron.py): the adapters put on the bare model as the trainer puts them (its recorded
    rank, alpha, targets), their keys loaded (the base is not read: model.path), and
    megatron-bridge's adapter export, which an adapter-only weight sync sends."""
    record = lora_record(src)
    if record is None:
        raise CheckpointError(f"{src} holds no model.lora adapter (its meta.json has no "
                              "extra_state.lora). Fix: convert it with --to hf")
    with bare_model(src, hf_config) as (bridge, chunks, _, config_src):
        lora.apply_lora(chunks, lora.recorded_model_config(record, config_src))
        state = load_dist_state(src, model_sharded_state_dict(chunks, adapter_only=True),
                                config_src)
        load_model_state(chunks[0], state["model"], adapter_only=True)
        return lora.adapter_tensors(bridge, chunks)


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
