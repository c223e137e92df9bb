"""The project's Qwen3-Omni (thinker) bridge, on megatron-bridge's public extension point:
`MegatronModelBridge.register_bridge` for transformers' Qwen3OmniMoeForConditionalGeneration.

Weights are read from and exported under the checkpoint files' names (what SGLang loads and
trainer=torch sends, modeling.checkpoint_names): `thinker.model.*` for the language model,
`thinker.visual.*`, `thinker.audio_tower.*`, `thinker.lm_head.weight`, the experts one tensor
per expert (`thinker.model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`), as the text
Qwen3-MoE bridge maps them. The talker's and code2wav's tensors map to nothing: never loaded,
never exported.

Imported only after cpu_compat.import_bridge (bridges.register).
"""

from __future__ import annotations

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping, GatedMLPMapping, QKVMapping, ReplicatedMapping,
)
from transformers import Qwen3OmniMoeForConditionalGeneration

from relax_slurm.errors import ConfigError
from relax_slurm.trainer.megatron.omni_model import OmniThinkerModel, OmniThinkerProvider

LAYER, HF_LAYER = "language_model.decoder.layers.*", "thinker.model.layers.*"


def mappings() -> list:
    """Every thinker parameter: megatron name -> the file's name(s)."""
    plain = {
        "language_model.embedding.word_embeddings.weight": "thinker.model.embed_tokens.weight",
        "language_model.output_layer.weight": "thinker.lm_head.weight",
        "language_model.decoder.final_layernorm.weight": "thinker.model.norm.weight",
        # transformer-engine fuses the norm into the qkv linear; megatron-core's local layers
        # (CPU) keep it apart
        f"{LAYER}.self_attention.linear_qkv.layer_norm_weight":
            f"{HF_LAYER}.input_layernorm.weight",
        f"{LAYER}.input_layernorm.weight": f"{HF_LAYER}.input_layernorm.weight",
        f"{LAYER}.pre_mlp_layernorm.weight": f"{HF_LAYER}.post_attention_layernorm.weight",
        f"{LAYER}.mlp.linear_fc1.layer_norm_weight": f"{HF_LAYER}.post_attention_layernorm.weight",
        f"{LAYER}.self_attention.linear_proj.weight": f"{HF_LAYER}.self_attn.o_proj.weight",
        f"{LAYER}.self_attention.q_layernorm.weight": f"{HF_LAYER}.self_attn.q_norm.weight",
        f"{LAYER}.self_attention.k_layernorm.weight": f"{HF_LAYER}.self_attn.k_norm.weight",
        f"{LAYER}.mlp.router.weight": f"{HF_LAYER}.mlp.gate.weight",
        f"{LAYER}.mlp.linear_fc2.weight": f"{HF_LAYER}.mlp.down_proj.weight",  # mlp_only_layers
    }
    out: list = [AutoMapping(megatron_param=k, hf_param=v) for k, v in plain.items()]
    out.append(QKVMapping(megatron_param=f"{LAYER}.self_attention.linear_qkv.weight",
                          q=f"{HF_LAYER}.self_attn.q_proj.weight",
                          k=f"{HF_LAYER}.self_attn.k_proj.weight",
                          v=f"{HF_LAYER}.self_attn.v_proj.weight"))
    out.append(GatedMLPMapping(megatron_param=f"{LAYER}.mlp.linear_fc1.weight",
                               gate=f"{HF_LAYER}.mlp.gate_proj.weight",
                               up=f"{HF_LAYER}.mlp.up_proj.weight"))
    experts = f"{HF_LAYER}.mlp.experts.*"
    # transformer-engine's grouped experts (`weight<E>`) and megatron-core's SequentialMLP
    # (`local_experts.<E>`, made global by model.fix_sequential_experts), as qwen3_moe_bridge
    for fc1, fc2 in ((f"{LAYER}.mlp.experts.linear_fc1.weight*",
                      f"{LAYER}.mlp.experts.linear_fc2.weight*"),
                     (f"{LAYER}.mlp.experts.local_experts.*.linear_fc1.weight",
                      f"{LAYER}.mlp.experts.local_experts.*.linear_fc2.weight")):
        out.append(GatedMLPMapping(megatron_param=fc1, gate=f"{experts}.gate_proj.weight",
                                   up=f"{experts}.up_proj.weight"))
        out.append(AutoMapping(megatron_param=fc2, hf_param=f"{experts}.down_proj.weight"))
    # the towers: HF modules under their HF names, whole on every rank
    out.append(ReplicatedMapping(megatron_param="vision_model.**", hf_param="thinker.visual.**"))
    out.append(ReplicatedMapping(megatron_param="audio_model.**",
                                 hf_param="thinker.audio_tower.**"))
    return out


@MegatronModelBridge.register_bridge(source=Qwen3OmniMoeForConditionalGeneration,
                                     target=OmniThinkerModel, provider=OmniThinkerProvider,
                                     model_type="qwen3_omni_moe")
class Qwen3OmniThinkerBridge(MegatronModelBridge):
    """Qwen3-Omni (thinker) <-> OmniThinkerModel."""

    def provider_bridge(self, hf_pretrained) -> OmniThinkerProvider:
        thinker = hf_pretrained.config.thinker_config
        text = thinker.text_config
        if not getattr(text, "norm_topk_prob", True):
            # megatron's router (softmax after top-k) renormalises the chosen experts' weights
            raise ConfigError("trainer=megatron: this Qwen3-Omni's norm_topk_prob=false has no "
                              "megatron router equivalent. Fix: trainer=torch")
        kwargs = self.hf_config_to_provider_kwargs(text)
        dtype = kwargs.get("params_dtype", torch.float32)
        thinker.vision_config.dtype = thinker.audio_config.dtype = dtype
        p = OmniThinkerProvider(**kwargs)
        p.normalization, p.gated_linear_unit, p.qk_layernorm = "RMSNorm", True, True
        p.add_qkv_bias, p.add_bias_linear = bool(getattr(text, "attention_bias", False)), False
        p.hidden_dropout = 0.0
        p.share_embeddings_and_output_weights = bool(getattr(thinker, "tie_word_embeddings", False))
        p.moe_ffn_hidden_size = text.moe_intermediate_size
        p.num_moe_experts, p.moe_router_topk = text.num_experts, text.num_experts_per_tok
        p.decoder_sparse_step = getattr(text, "decoder_sparse_step", 1)
        p.mlp_only_layers = list(getattr(text, "mlp_only_layers", None) or [])
        p.moe_grouped_gemm, p.moe_router_load_balancing_type = True, "aux_loss"
        # the checkpoint's own coefficient (Qwen3-VL-MoE's bridge hard-codes 1e-3)
        p.moe_aux_loss_coeff = float(getattr(text, "router_aux_loss_coef", 1e-3))
        p.moe_router_pre_softmax = False
        p.position_embedding_type = "mrope"
        p.mrope_section = list((getattr(text, "rope_parameters", None) or {}).get(
            "mrope_section", [24, 20, 20]))
        p.head_dim = getattr(text, "head_dim", text.hidden_size // text.num_attention_heads)
        p.vision_config, p.audio_config, p.thinker_config = (
            thinker.vision_config, thinker.audio_config, thinker)
        p.hf_text_config = text
        p.image_token_id, p.video_token_id = thinker.image_token_id, thinker.video_token_id
        p.vision_start_token_id = thinker.vision_start_token_id
        p.vision_end_token_id = getattr(thinker, "vision_end_token_id", 151653)
        # trainer=megatron freezes only what trainer.freeze_modules names
        p.freeze_language_model = p.freeze_vision_model = p.freeze_vision_projection = False
        return p

    def mapping_registry(self) -> MegatronMappingRegistry:
        return MegatronMappingRegistry(*mappings())
