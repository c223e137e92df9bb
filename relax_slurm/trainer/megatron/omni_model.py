"""Qwen3-Omni's thinker as a megatron model (omni.py registers its bridge): megatron-bridge's
Qwen3-VL model (modelling_qwen3_vl/model.py: megatron-core's GPT/MoE language model with
M-RoPE and DeepStack) holding Qwen3-Omni's own vision and audio towers, the HF modules,
replicated on every TP rank as the Qwen3-VL vision tower is (vl.py). The talker and code2wav
are not built: RL trains the thinker's text (modeling.NOT_SERVED).

Imported only after cpu_compat.import_bridge (megatron-bridge needs transformer-engine or its
stub at import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.bridge.models.qwen_vl import qwen3_vl_provider as qp
from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as m
from megatron.bridge.utils.common_utils import hook_hf_module_setattr_for_tp_grad_sync
from torch import Tensor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder, Qwen3OmniMoeVisionEncoder,
)

from relax_slurm.trainer.megatron import tower_split
from relax_slurm.trainer.megatron.omni_rope import omni_rope_index
from relax_slurm.trainer.megatron.vl import language_forward, merge_vision


class OmniThinkerModel(m.Qwen3VLModel):
    """Qwen3VLModel with Qwen3-Omni's vision encoder (its parameter names: `merger_list`,
    `merger.ln_q`) in place of Qwen3-VL's, an audio encoder (`audio_model`) and the Omni
    forward (audio, images and videos placed at their pad tokens, Omni's M-RoPE positions)."""

    def __init__(self, language_transformer_config, language_transformer_layer_spec,
                 vision_config, audio_config, thinker_config, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None) -> None:
        # Qwen3VLModel.__init__ builds the module-level Qwen3VLVisionModelHF: the Omni encoder
        # is built in its place (not Qwen3-VL's, then thrown away: a 0.6B-parameter tower)
        saved, m.Qwen3VLVisionModelHF = m.Qwen3VLVisionModelHF, Qwen3OmniMoeVisionEncoder
        try:
            super().__init__(language_transformer_config, language_transformer_layer_spec,
                             vision_config, pre_process=pre_process,
                             post_process=post_process, pg_collection=pg_collection)
        finally:
            m.Qwen3VLVisionModelHF = saved
        self.thinker_config = thinker_config
        self.audio_token_id = thinker_config.audio_token_id
        self.audio_model = None
        if pre_process:
            self.audio_model = Qwen3OmniMoeAudioEncoder._from_config(audio_config)
            hook_hf_module_setattr_for_tp_grad_sync(self.audio_model)
            if torch.cuda.is_available():
                self.audio_model = self.audio_model.to("cuda")

    def _vision(self, pixels: Tensor, grid: Tensor) -> tuple[Tensor, list[Tensor]]:
        out = self.vision_model(pixels.to(self.vision_model.dtype), grid_thw=grid)
        return out.pooler_output, out.deepstack_features

    def _audio(self, features: Tensor, feature_mask: Tensor) -> Tensor:
        """transformers' get_audio_features: the valid frames of every audio, concatenated
        [mel, frames], through the encoder -> one embedding per audio token, in order."""
        lengths = feature_mask.sum(1)
        flat = features.permute(0, 2, 1)[feature_mask.bool()].permute(1, 0)
        return self.audio_model(flat.to(self.audio_model.dtype), feature_lens=lengths,
                                return_dict=True).last_hidden_state

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, labels: Tensor | None = None,
                pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                video_grid_thw=None, video_second_per_grid=None, input_features=None,
                feature_attention_mask=None, pad_mask: Tensor | None = None, **_) -> Tensor:
        """Qwen3OmniMoeThinkerModel.forward's computation (transformers 5) with megatron's
        language model: `pad_mask` [B, T] shapes the positions only (rows right-padded: the
        layers' causal mask is the whole mask)."""
        from megatron.core import tensor_parallel

        cfg = self.config
        emb = visual_mask = deepstack = None
        if self.pre_process:
            split = tower_split.is_split(cfg)
            emb = self.language_model.embedding(input_ids=input_ids, position_ids=None).clone()
            emb = emb.transpose(0, 1).contiguous()  # [B,T,H], indexed by the [B,T] masks
            if input_features is not None:
                audio = input_ids == self.audio_token_id
                emb[audio] = tower_split.audio(self._audio, split)(
                    input_features, feature_attention_mask).to(emb.dtype)
            items = [(pixels, grid, input_ids == token) for pixels, grid, token in (
                (pixel_values, image_grid_thw, self.image_token_id),
                (pixel_values_videos, video_grid_thw, self.video_token_id)) if pixels is not None]
            if items:
                emb, visual_mask, deepstack = merge_vision(
                    emb, items, tower_split.vision(self._vision, split))
            emb = emb.transpose(0, 1).contiguous()
            if cfg.sequence_parallel:
                emb = tensor_parallel.scatter_to_sequence_parallel_region(emb).contiguous()
        if position_ids is None:
            lengths = None if feature_attention_mask is None else feature_attention_mask.sum(1)
            position_ids = omni_rope_index(
                self.thinker_config, input_ids, pad_mask, image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw, audio_feature_lengths=lengths,
                second_per_grid=video_second_per_grid)
        return language_forward(self, emb, position_ids, attention_mask, labels, visual_mask,
                                deepstack)


@dataclass
class OmniThinkerProvider(qp.Qwen3VLMoEModelProvider):
    """The Qwen3-VL-MoE provider (language model fields, MoE, M-RoPE) building the thinker."""

    audio_config: Any = None
    thinker_config: Any = None
    pretrained_model_name: str = "Qwen/Qwen3-Omni-30B-A3B-Instruct"

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> OmniThinkerModel:
        # the module attribute: cpu_compat.local_vl_layer_specs replaces it on CPU
        spec = qp.get_gpt_layer_with_transformer_engine_spec(
            num_experts=self.num_moe_experts, moe_grouped_gemm=True,
            qk_layernorm=self.qk_layernorm, fp8=False)
        return OmniThinkerModel(
            self, spec, self.vision_config, self.audio_config, self.thinker_config,
            pre_process=True if pre_process is None else pre_process,
            post_process=True if post_process is None else post_process,
            pg_collection=self._pg_collection)
