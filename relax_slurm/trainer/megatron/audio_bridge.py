"""The project's Qwen2-Audio bridge, on megatron-bridge's public extension point:
`MegatronModelBridge.register_bridge` for transformers' Qwen2AudioForConditionalGeneration
(megatron-bridge 0.3.1 has none).

Weights are read from and exported under the checkpoint files' names (what SGLang loads and
trainer=torch sends, modeling.checkpoint_names): `language_model.model.*` and
`language_model.lm_head.weight` for the language model (Qwen2's layout: fused QKV with bias,
gated MLP), `audio_tower.*` and `multi_modal_projector.*` for the replicated audio parts.

Imported only after cpu_compat.import_bridge (bridges.register).
"""

from __future__ import annotations

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping, GatedMLPMapping, QKVMapping, ReplicatedMapping,
)
from transformers import Qwen2AudioForConditionalGeneration

from relax_slurm.trainer.megatron.audio_model import Qwen2AudioMegatronModel, Qwen2AudioProvider

LAYER, HF_LAYER = "language_model.decoder.layers.*", "language_model.model.layers.*"


def mappings() -> list:
    """Every parameter: megatron name -> the file's name(s). The layer norms under
    transformer-engine's fused names; megatron-bridge's registry maps megatron-core's local
    layers' own (`input_layernorm`, `pre_mlp_layernorm`: CPU) to the same."""
    plain = {
        "language_model.embedding.word_embeddings.weight": "language_model.model.embed_tokens.weight",
        "language_model.output_layer.weight": "language_model.lm_head.weight",
        "language_model.decoder.final_layernorm.weight": "language_model.model.norm.weight",
        f"{LAYER}.self_attention.linear_qkv.layer_norm_weight":
            f"{HF_LAYER}.input_layernorm.weight",
        f"{LAYER}.mlp.linear_fc1.layer_norm_weight": f"{HF_LAYER}.post_attention_layernorm.weight",
        f"{LAYER}.self_attention.linear_proj.weight": f"{HF_LAYER}.self_attn.o_proj.weight",
        f"{LAYER}.mlp.linear_fc2.weight": f"{HF_LAYER}.mlp.down_proj.weight",
    }
    out: list = [AutoMapping(megatron_param=k, hf_param=v) for k, v in plain.items()]
    for part in ("weight", "bias"):
        out.append(QKVMapping(megatron_param=f"{LAYER}.self_attention.linear_qkv.{part}",
                              q=f"{HF_LAYER}.self_attn.q_proj.{part}",
                              k=f"{HF_LAYER}.self_attn.k_proj.{part}",
                              v=f"{HF_LAYER}.self_attn.v_proj.{part}"))
    out.append(GatedMLPMapping(megatron_param=f"{LAYER}.mlp.linear_fc1.weight",
                               gate=f"{HF_LAYER}.mlp.gate_proj.weight",
                               up=f"{HF_LAYER}.mlp.up_proj.weight"))
    # the audio parts: HF modules under their HF names, whole on every rank
    for tower in ("audio_tower", "multi_modal_projector"):
        out.append(ReplicatedMapping(megatron_param=f"{tower}.**", hf_param=f"{tower}.**"))
    return out


@MegatronModelBridge.register_bridge(source=Qwen2AudioForConditionalGeneration,
                                     target=Qwen2AudioMegatronModel, provider=Qwen2AudioProvider,
                                     model_type="qwen2_audio")
class Qwen2AudioBridge(MegatronModelBridge):
    """Qwen2-Audio <-> Qwen2AudioMegatronModel."""

    def provider_bridge(self, hf_pretrained) -> Qwen2AudioProvider:
        config = hf_pretrained.config
        text = config.text_config
        kwargs = self.hf_config_to_provider_kwargs(text)
        config.audio_config.dtype = kwargs.get("params_dtype", torch.float32)
        p = Qwen2AudioProvider(**kwargs)
        # Qwen2's layout (megatron-bridge's Qwen2Bridge.provider_bridge)
        p.normalization, p.gated_linear_unit, p.position_embedding_type = "RMSNorm", True, "rope"
        p.add_qkv_bias, p.add_bias_linear, p.hidden_dropout = True, False, 0.0
        p.share_embeddings_and_output_weights = bool(
            getattr(config, "tie_word_embeddings", False)
            or getattr(text, "tie_word_embeddings", False))
        p.audio_config, p.hf_config = config.audio_config, config
        p.audio_token_id = config.audio_token_id
        return p

    def mapping_registry(self) -> MegatronMappingRegistry:
        return MegatronMappingRegistry(*mappings())
