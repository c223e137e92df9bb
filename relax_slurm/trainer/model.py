"""The torch backend: a transformers model under DDP or FSDP2, its optimizer and schedule.

The model is read with the ordinary `from_pretrained` path, the same code that would load
Qwen3-4B; nothing here knows the model is tiny.
"""

from __future__ import annotations

import functools
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

from relax_slurm.config.schema import ModelConfig, TrainerConfig
from relax_slurm.trainer.schedule import lr_factor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(cfg: ModelConfig, device: torch.device) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        cfg.path, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
    )
    model.config.use_cache = False  # training never reuses a KV cache
    return model.to(device)


def load_reference_model(cfg: ModelConfig, device: torch.device) -> nn.Module:
    """A frozen copy of `model.path` for the KL loss: eval mode, no gradients, a plain replica on
    every rank (not sharded: it only runs forward passes, on this rank's micro-batches)."""
    model = load_hf_model(cfg, device).eval()
    model.requires_grad_(False)
    return model


def wrap_parallel(model: nn.Module, cfg: TrainerConfig, device: torch.device) -> nn.Module:
    """DDP replicates and all-reduces gradients; FSDP2 shards parameters across ranks."""
    if dist.get_world_size() == 1:
        return model
    if cfg.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def build_optimizer(model: nn.Module, cfg: TrainerConfig):
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        lr_factor, total_steps=cfg.lr_decay_steps or cfg.total_steps,
        warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio))
    return opt, sched


def full_named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors for the engines, tied weights once (as named_parameters gives them).

    Under FSDP2 every rank must iterate (full_tensor() is a collective); only rank 0 sends.
    """
    for name, p in unwrap(model).named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t
