"""model.lora in the torch backend: PEFT's LoRA on the frozen model.path (docs/lora.md).

- the policy is `peft.get_peft_model(model, LoraConfig(...))`: the base weights frozen, one
  adapter ("default") trained;
- the reference of the KL loss is the same model with its adapter disabled (`AdapterDisabled`):
  model.path exactly, with no second copy of the weights;
- a weight sync sends the adapter alone (`adapter_of`, PEFT's saved names and config: what
  SGLang's /load_lora_adapter_from_tensors and PEFT's from_pretrained read), or, where the
  engines cannot serve adapters, the merged weights (`merged_parameters`: W + scale * B @ A
  under the base model's own names);
- a checkpoint holds the adapter and its optimizer state only (the trainable parameters), and
  meta.json the adapter config with model.path as its base (`checkpoint_record`).
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor, nn

from relax_slurm.checkpoint.from_lora import ADAPTER_NAME, LORA_KEY
from relax_slurm.config.model import ModelConfig
from relax_slurm.errors import ConfigError
from relax_slurm.weightsync.adapter import Adapter

# peft is imported where an adapter is made or read, not with this module: importing it costs
# ~2.5 CPU-s (it pulls transformers' model machinery), which every trainer rank paid at start,
# LoRA or not (the megatron backend imports this module for check_mergeable)
if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel

# PEFT's name of the one adapter trained, and the meta.json extra_state key of the adapter's
# record: relax-convert reads checkpoints by these (checkpoint/from_lora.py), so they live there
ADAPTER, CHECKPOINT_KEY = ADAPTER_NAME, LORA_KEY


def peft_config(cfg: ModelConfig) -> PeftLoraConfig:
    from peft import LoraConfig as PeftLoraConfig

    lora = cfg.lora
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
                          base_model_name_or_path=cfg.path)


def apply_lora(model: nn.Module, cfg: ModelConfig) -> PeftModel:
    """`model` with adapters on model.lora.target_modules; only they require gradients. PEFT
    starts B at zero, so the first policy is model.path exactly."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(cfg))


def check_mergeable(hf_config, cfg: ModelConfig, why: str) -> None:
    """Merged weights cannot carry an adapter on an lm_head that model.path ties to
    embed_tokens: there is no head weight of its own to merge it into (the engines would tie
    a merged head back onto the embeddings; megatron-bridge's merged export has no lm_head and
    drops it). An adapter-only sync serves it as trained. Both trainers refuse it by this one
    rule, before the first step; `why`: what in the run needs merged weights, and its fix.
    `hf_config`: the model's transformers config (a multimodal one keeps the flag in its text
    config)."""
    tied = getattr(hf_config.get_text_config(), "tie_word_embeddings", False) or getattr(
        hf_config, "tie_word_embeddings", False)
    if tied and "lm_head" in cfg.lora.target_modules:
        raise ConfigError(
            f"model.lora.target_modules has lm_head, whose weight {cfg.path} ties to "
            f"embed_tokens, and {why}: merged weights have no head of their own to carry its "
            "adapter. Fix: drop lm_head from model.lora.target_modules, or the merged weights")


def is_peft(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # not imported: no PeftModel was ever made
    return peft is not None and isinstance(model, peft.PeftModel)


def jsonable(value: Any) -> Any:
    """PEFT's config as adapter_config.json holds it (sets as sorted lists, enums as values)."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


def adapter_config(model: PeftModel) -> dict[str, Any]:
    return jsonable(model.peft_config[ADAPTER].to_dict())


@torch.no_grad()
def adapter_of(model: PeftModel, dtype: torch.dtype | None = None) -> Adapter:
    """The trained adapter under PEFT's saved names, in the engines' dtype (model.dtype).
    Under FSDP2 every rank calls it (each tensor is gathered whole) and gets it all."""
    # save_embedding_layers: PEFT's "auto" would add the whole (frozen) embedding matrix when
    # lm_head is a target, every sync; the engines hold it already
    from peft import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)
    cast = {}
    for n, t in tensors.items():  # the same order on every rank: full() is a collective
        t = full(t.detach())
        cast[n] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return Adapter(adapter_config(model), cast)


def full(t: Tensor) -> Tensor:
    """A whole tensor: an FSDP2 shard (DTensor) gathered from every rank (a collective: every
    rank calls it, in the same order), any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def delta_weight(module) -> Tensor:
    """scale * B @ A of a PEFT LoRA layer's adapter, whole. Under FSDP2, A and B are gathered
    first and multiplied as PEFT's Linear does (PEFT's own get_delta_weight would multiply the
    shards as DTensors, another summation than the one-process merge)."""
    from peft.utils.other import transpose

    a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
    if not hasattr(a, "full_tensor"):
        return module.get_delta_weight(ADAPTER)
    return transpose(full(b) @ full(a), module.fan_in_fan_out) * module.scaling[ADAPTER]


@torch.no_grad()
def merged_parameters(model: PeftModel) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of the base model's parameters as transformers names them, each adapted
    weight merged (W + scale * B @ A, computed aside: the model's own weights stay as they
    are, since merging in place and back would not give them back bit for bit). Whole tensors;
    under FSDP2 every rank iterates it (each shard is gathered)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            deltas[f"{name}.base_layer.weight"] = delta_weight(module)
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        t = full(p.detach())
        if name in deltas:
            t = t + deltas[name].to(t.dtype)
        yield name.replace(".base_layer.", "."), t


class AdapterDisabled:
    """The reference policy: the policy's PEFT model with its adapter off, which is model.path
    itself (forward only; the trainer calls it like a model)."""

    def __init__(self, model: PeftModel) -> None:
        self._model = model

    @property
    def config(self):
        return self._model.config

    def __call__(self, **kwargs: Any):
        with self._model.disable_adapter():
            return self._model(**kwargs)


def checkpoint_record(model: PeftModel, base_path: str) -> dict[str, Any]:
    """What meta.json records of the adapter: its PEFT config, and the base model it adapts."""
    return {"base_model_path": base_path, "adapter_config": adapter_config(model)}
