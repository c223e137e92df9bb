"""The torch backend: a transformers model under DDP or FSDP2, its optimizer and schedule.

The model is read with the ordinary `from_pretrained` path, the same code that would load
Qwen3-4B; nothing here knows the model is tiny.
"""

from __future__ import annotations

import functools
import contextlib
import socket
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.errors import ConfigError
from relax_slurm.modeling import (NOT_SERVED, auto_model_class, checkpoint_names,
                                  checkpoint_views, text_only_kwargs)
from relax_slurm.trainer.schedule import lr_factor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(cfg: ModelConfig, device: torch.device, trained: bool = False,
                  text_only: bool = False, recompute: str = "none") -> nn.Module:
    """The causal LM, or the multimodal model (VL, audio, omni) the directory holds.

    `trained`: an optimizer updates these weights, so they are kept in float32 whatever
    model.dtype says, and a bfloat16/float16 model.dtype is the forward's compute dtype
    (`compute_in`). AdamW on bf16 parameters rounds most updates away: at lr 1e-6 an update is
    far below bf16's resolution of a weight (8 bits of mantissa). `text_only`: a speech-output
    model's talker and code2wav are not built (`modeling.text_only_kwargs`: Qwen3-Omni's
    thinker alone, under its `thinker.*` names). `recompute`: trainer.recompute of a trained
    model (`recompute_layers`)."""
    dtype = DTYPES[cfg.dtype]
    model = auto_model_class(cfg.path).from_pretrained(
        cfg.path, dtype=torch.float32 if trained else dtype,
        trust_remote_code=cfg.trust_remote_code,
        **(text_only_kwargs(cfg.path) if text_only else {})
    )
    model.config.use_cache = False  # training never reuses a KV cache
    model = model.to(device)
    if trained and dtype != torch.float32:
        compute_in(model, dtype, device)
    if trained and recompute == "full":
        recompute_layers(model)
    return model


def recompute_layers(model: nn.Module) -> None:
    """trainer.recompute=full: transformers' gradient checkpointing, each decoder layer's
    forward run again in the backward from its saved input (non-reentrant: works under
    autocast, DDP, FSDP2 and PEFT's frozen inputs alike). Dropout is 0 in RL, so the
    recomputed forward is the first one exactly."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compute_in(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """The model's forward runs under autocast to `dtype` (matmuls in half precision, its
    reductions in float32) over its float32 master weights. Set on this instance's forward, so
    DDP, FSDP2 and every caller of the model get it, and its state_dict keeps its names."""
    model.forward = torch.autocast(device.type, dtype=dtype)(model.forward)


def pad_token_id(config) -> int:
    """The pad id of a causal LM's config, or of a multimodal one's text config; else 0."""
    for c in (config, getattr(config, "text_config", None)):
        value = getattr(c, "pad_token_id", None) if c is not None else None
        if value is not None:
            return int(value)
    return 0


def load_reference_model(cfg: ModelConfig, device: torch.device, text_only: bool = False
                         ) -> nn.Module:
    """A frozen copy of `model.path` for the KL loss: eval mode, no gradients, a plain replica on
    every rank (not sharded: it only runs forward passes, on this rank's micro-batches).
    `text_only`: see `load_hf_model`."""
    model = load_hf_model(cfg, device, text_only=text_only).eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def refresh_reference(ref: nn.Module, model: nn.Module) -> None:
    """Copy the policy's current weights into the frozen reference (algo.ref_update_interval).
    Collective under FSDP2 (every rank gathers each full tensor: the reference is a replica)."""
    params = dict(ref.named_parameters())
    for name, p in unwrap(model).named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        params[name].copy_(t)


def reference_due(steps_done: int, interval: int | None) -> bool:
    """Whether the reference is refreshed after the `steps_done`-th rollout batch: every
    `interval` batches (after batches interval, 2 x interval, ...); never when None."""
    return interval is not None and steps_done % interval == 0


def freeze_modules(model: nn.Module, prefixes: list[str]) -> int:
    """Stop training the parameters under these name prefixes (`trainer.freeze_modules`, e.g.
    the vision tower `model.visual`); they still go to the engines with every weight sync.
    Returns how many parameters were frozen; ConfigError for a prefix that matches nothing.

    A prefix may name the parameters as transformers holds them or as the checkpoint files do
    (`modeling.checkpoint_names`): Qwen3-Omni's audio tower is `thinker.audio_tower` in the
    files users read and `thinker.model.audio_tower` in transformers 5's memory."""
    on_file = {name: file for file, name in checkpoint_names(model).items()}

    def under(name: str, prefix: str) -> bool:
        return any(n == prefix or n.startswith(prefix + ".")
                   for n in (name, on_file.get(name, name)))

    frozen = 0
    for prefix in prefixes:
        hits = [p for n, p in model.named_parameters() if under(n, prefix)]
        if not hits:
            tops = sorted({".".join(n.split(".")[:2]) for n, _ in model.named_parameters()})
            raise ConfigError(f"trainer.freeze_modules: {prefix!r} matches no parameter. Fix: "
                              f"use a module name prefix, e.g. one of {tops}")
        for p in hits:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layers (FSDP2 shards each): causal LMs and multimodal models."""
    if hasattr(model, "get_base_model"):  # model.lora: PEFT's wrapper around the HF model
        model = model.get_base_model()
    inner = model.model
    return inner.layers if hasattr(inner, "layers") else inner.language_model.layers


@contextlib.contextmanager
def single_process_group():
    """A one-rank gloo group (megatron-core needs torch.distributed), unless one exists."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrap_parallel(model: nn.Module, cfg: TrainerConfig, device: torch.device) -> nn.Module:
    """DDP replicates and all-reduces gradients; FSDP2 shards parameters across ranks."""
    if dist.get_world_size() == 1:
        return model
    if cfg.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def release_cached_memory() -> None:
    """The CUDA caching allocator's free blocks back to the device (for engines sharing it);
    nothing to do on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def build_optimizer(model: nn.Module, cfg: TrainerConfig, lr: float | None = None):
    """AdamW over the trainable parameters at `lr` (None: trainer.lr; model.lora.lr passes
    its own) with trainer's lr schedule."""
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr if lr is None else lr,
        weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        lr_factor, total_steps=cfg.lr_decay_steps or cfg.total_steps,
        warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio))
    return opt, sched


def full_named_weights(model: nn.Module, dtype: torch.dtype | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors for the engines, tied weights once (as named_parameters gives them);
    fused MoE experts one view per expert, under the checkpoint files' names that SGLang loads
    (`relax_slurm.modeling.checkpoint_views`). `dtype`: what the engines serve (model.dtype;
    the float32 master weights of a bf16 run are sent in bf16, half the bytes).

    Names are the checkpoint files' where transformers 5 renamed a parameter in memory
    (Qwen2.5-VL: `model.language_model.*` -> `model.*`, `model.visual.*` -> `visual.*`;
    `relax_slurm.modeling.checkpoint_names`): SGLang's loaders know only those (the in-memory
    names failed the first push to a real SGLang Qwen2.5-VL server with HTTP 400); the hf
    engine accepts both.

    Parts that never change and that no engine uses for the policy's tokens are left out
    (`relax_slurm.modeling.NOT_SERVED`: Qwen3-Omni's talker and code2wav).

    Under FSDP2 every rank must iterate (full_tensor() is a collective); only rank 0 sends.
    """
    inner = unwrap(model)
    params = inner.named_parameters()
    if hasattr(inner, "get_base_model"):  # model.lora, merged (trainer/lora.py)
        from relax_slurm.trainer.lora import merged_parameters

        inner, params = inner.get_base_model(), merged_parameters(inner)
    file_name: dict[str, str] = {}
    for file, name in checkpoint_names(inner).items():
        file_name.setdefault(name, file)
    for name, p in params:
        if name.startswith(NOT_SERVED):  # no gradient reaches them (Qwen3-Omni's speech parts)
            continue
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield from checkpoint_views(file_name.get(name, name), t)
