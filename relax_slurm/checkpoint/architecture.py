"""A checkpoint's tensors against the architecture its HF config describes: the model built on
the meta device (names, shapes, tied weights), so a checkpoint never silently lands in the
wrong model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from relax_slurm.checkpoint.resume import CheckpointError

def load_config(src: str | Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(src), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise CheckpointError(f"cannot read a Hugging Face config from {src}: {e}. Fix: pass "
                              "--hf-config with the model directory the run started from") from e


def meta_model(config, trust_remote_code: bool = False) -> nn.Module:
    """The model of `config` on the meta device (no memory): names, shapes and tied weights."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(
            config, trust_remote_code=trust_remote_code)


def expected_tensors(model: nn.Module) -> tuple[dict[str, torch.Size], set[str]]:
    """(state-dict name -> shape, names that alias another tensor: tied weights)."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    owned = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return shapes, set(shapes) - owned


def check_architecture(
    found: dict[str, torch.Size], expected: dict[str, torch.Size], aliases: set[str], what: str,
    config_src: Any,
    fix: str = "pass --hf-config with the model directory this checkpoint was trained from",
) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped tensors."""
    missing = sorted(set(expected) - set(found) - aliases)
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{k}: {tuple(found[k])} vs {tuple(expected[k])}"
             for k in sorted(set(found) & set(expected)) if found[k] != expected[k]]
    if missing or unexpected or wrong:
        parts = [f"{len(missing)} missing (e.g. {missing[:3]})" if missing else "",
                 f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})" if unexpected else "",
                 f"{len(wrong)} with other shapes (e.g. {wrong[:3]})" if wrong else ""]
        raise CheckpointError(
            f"{what} does not match the architecture of {config_src}: "
            + "; ".join(p for p in parts if p)
            + f". Fix: {fix}"
        )


def unwrap_model(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def tied_sources(model: nn.Module, aliases: set[str]) -> dict[str, str]:
    """alias name -> the parameter it shares storage with (by identity on the meta model)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    by_id.update({id(b): n for n, b in model.named_buffers()})
    sd = model.state_dict(keep_vars=True)
    return {a: by_id[id(sd[a])] for a in aliases}
