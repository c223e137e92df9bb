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
from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping
from transformers import Qwen2AudioForConditionalGeneration

from relax_slurm.trainer.megatron import qwen2_parts
from relax_slurm.trainer.megatron.audio_model import Qwen2AudioMegatronModel, Qwen2AudioProvider


def mappings() -> list:
    """Every parameter: megatron name -> the file's name(s)."""
    out = qwen2_parts.language_mappings("language_model.model", "language_model.lm_head.weight")
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
        qwen2_parts.qwen2_layout(p, tied=getattr(config, "tie_word_embeddings", False)
                                 or getattr(text, "tie_word_embeddings", False))
        p.position_embedding_type = "rope"
        p.audio_config, p.hf_config = config.audio_config, config
        p.audio_token_id = config.audio_token_id
        return p

    def mapping_registry(self) -> MegatronMappingRegistry:
        return MegatronMappingRegistry(*mappings())
