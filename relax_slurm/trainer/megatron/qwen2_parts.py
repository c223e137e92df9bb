"""What the project's bridges of models with a Qwen2 language model share (Qwen2-Audio:
audio_*.py; the Qwen2.5-Omni thinker: omni25_*.py): the language model's parameter mappings
under a file prefix, Qwen2's layout on a provider, and the HF towers held whole on every TP
rank (`TowersModel`).

Imported only after cpu_compat.import_bridge (bridges.register).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping, GatedMLPMapping, QKVMapping,
)
from megatron.bridge.utils.common_utils import hook_hf_module_setattr_for_tp_grad_sync
from megatron.core.transformer.module import MegatronModule

LAYER = "language_model.decoder.layers.*"


def language_mappings(hf_model: str, hf_head: str) -> list:
    """megatron-core's GPT language model (`language_model.*`) -> the file's Qwen2 names under
    `hf_model` (`language_model.model`, `thinker.model`) and its head `hf_head`: fused QKV with
    bias, gated MLP. The layer norms under transformer-engine's fused names; megatron-bridge's
    registry maps megatron-core's local layers' own (`input_layernorm`, `pre_mlp_layernorm`:
    CPU) to the same."""
    hf_layer = f"{hf_model}.layers.*"
    plain = {
        "language_model.embedding.word_embeddings.weight": f"{hf_model}.embed_tokens.weight",
        "language_model.output_layer.weight": hf_head,
        "language_model.decoder.final_layernorm.weight": f"{hf_model}.norm.weight",
        f"{LAYER}.self_attention.linear_qkv.layer_norm_weight":
            f"{hf_layer}.input_layernorm.weight",
        f"{LAYER}.mlp.linear_fc1.layer_norm_weight": f"{hf_layer}.post_attention_layernorm.weight",
        f"{LAYER}.self_attention.linear_proj.weight": f"{hf_layer}.self_attn.o_proj.weight",
        f"{LAYER}.mlp.linear_fc2.weight": f"{hf_layer}.mlp.down_proj.weight",
    }
    out: list = [AutoMapping(megatron_param=k, hf_param=v) for k, v in plain.items()]
    for part in ("weight", "bias"):
        out.append(QKVMapping(megatron_param=f"{LAYER}.self_attention.linear_qkv.{part}",
                              q=f"{hf_layer}.self_attn.q_proj.{part}",
                              k=f"{hf_layer}.self_attn.k_proj.{part}",
                              v=f"{hf_layer}.self_attn.v_proj.{part}"))
    out.append(GatedMLPMapping(megatron_param=f"{LAYER}.mlp.linear_fc1.weight",
                               gate=f"{hf_layer}.mlp.gate_proj.weight",
                               up=f"{hf_layer}.mlp.up_proj.weight"))
    return out


def qwen2_layout(p, tied: bool) -> None:
    """Qwen2's layout on a provider (megatron-bridge's Qwen2Bridge.provider_bridge): RMSNorm,
    gated SiLU MLP, QKV bias, no other bias, no dropout; the head tied to the embedding when
    the checkpoint ties it."""
    p.normalization, p.gated_linear_unit, p.qk_layernorm = "RMSNorm", True, False
    p.add_qkv_bias, p.add_bias_linear, p.hidden_dropout = True, False, 0.0
    p.share_embeddings_and_output_weights = bool(tied)


def replicate(towers, dtype: torch.dtype) -> None:
    """HF towers held whole on every TP rank: in the parameters' dtype, their gradients
    averaged over TP by megatron's finalize (`average_gradients_across_tp_domain`, set by
    hook_hf_module_setattr_for_tp_grad_sync; equal on every rank, so the average is each),
    on the GPU where there is one."""
    for tower in towers:
        tower.to(dtype)
        hook_hf_module_setattr_for_tp_grad_sync(tower)
        if torch.cuda.is_available():
            tower.to("cuda")


class TowersModel(MegatronModule):
    """HF towers (built by the subclass, on the first pipeline stage) ahead of megatron-core's
    GPT language model (`language_model`, `build_language_model`), the provider's."""

    def __init__(self, config, pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None) -> None:
        super().__init__(config=config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage

    def build_language_model(self) -> None:
        self.language_model = self.config.provide_language_model(
            pre_process=self.pre_process, post_process=self.post_process,
            vp_stage=self.vp_stage)
        # megatron's finalize of the gradients reads these on the model chunk
        self.share_embeddings_and_output_weights = (
            self.config.share_embeddings_and_output_weights)
        self.shared_embedding_or_output_weight = (
            self.language_model.shared_embedding_or_output_weight)

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)
