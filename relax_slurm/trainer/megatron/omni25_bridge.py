"""The project's Qwen2.5-Omni (thinker) bridge, on megatron-bridge's public extension point:
`MegatronModelBridge.register_bridge` for transformers' Qwen2_5OmniForConditionalGeneration
(megatron-bridge 0.3.1 has none).

Weights are read from and exported under the checkpoint files' names (what SGLang loads and
the hf engine takes, modeling.checkpoint_names): `thinker.model.*` for the language model
(Qwen2's layout: fused QKV with bias, gated MLP), `thinker.lm_head.weight`, `thinker.visual.*`
and `thinker.audio_tower.*` for the replicated towers. The talker's and token2wav's tensors
map to nothing: never loaded, never exported.

Imported only after cpu_compat.import_bridge (bridges.register).
"""

from __future__ import annotations

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping
from transformers import Qwen2_5OmniForConditionalGeneration

from relax_slurm.trainer.megatron import qwen2_parts
from relax_slurm.trainer.megatron.omni25_model import Omni25ThinkerModel, Omni25ThinkerProvider


def mappings() -> list:
    """Every thinker parameter: megatron name -> the file's name(s)."""
    out = qwen2_parts.language_mappings("thinker.model", "thinker.lm_head.weight")
    # the towers: HF modules under their HF names, whole on every rank
    for tower in ("visual", "audio_tower"):
        out.append(ReplicatedMapping(megatron_param=f"{tower}.**",
                                     hf_param=f"thinker.{tower}.**"))
    return out


@MegatronModelBridge.register_bridge(source=Qwen2_5OmniForConditionalGeneration,
                                     target=Omni25ThinkerModel, provider=Omni25ThinkerProvider,
                                     model_type="qwen2_5_omni")
class Qwen25OmniThinkerBridge(MegatronModelBridge):
    """Qwen2.5-Omni (thinker) <-> Omni25ThinkerModel."""

    def provider_bridge(self, hf_pretrained) -> Omni25ThinkerProvider:
        thinker = hf_pretrained.config.thinker_config
        text = thinker.text_config
        kwargs = self.hf_config_to_provider_kwargs(text)
        dtype = kwargs.get("params_dtype", torch.float32)
        thinker.vision_config.dtype = thinker.audio_config.dtype = dtype
        p = Omni25ThinkerProvider(**kwargs)
        # tied by the thinker's own key, as transformers ties it (its text config's defaults
        # to True)
        qwen2_parts.qwen2_layout(p, tied=getattr(thinker, "tie_word_embeddings", False))
        p.position_embedding_type = "mrope"  # sectioned (Qwen2-VL's), not Qwen3's interleaving
        p.mrope_section = list((getattr(text, "rope_parameters", None) or {}).get(
            "mrope_section", [16, 24, 24]))
        p.vision_config, p.audio_config, p.thinker_config = (
            thinker.vision_config, thinker.audio_config, thinker)
        p.image_token_id, p.video_token_id = thinker.image_token_id, thinker.video_token_id
        p.vision_start_token_id = getattr(thinker, "vision_start_token_id", 151652)
        p.vision_end_token_id = getattr(thinker, "vision_end_token_id", 151653)
        # trainer=megatron freezes only what trainer.freeze_modules names
        p.freeze_language_model = p.freeze_vision_model = p.freeze_vision_projection = False
        return p

    def mapping_registry(self) -> MegatronMappingRegistry:
        return MegatronMappingRegistry(*mappings())
