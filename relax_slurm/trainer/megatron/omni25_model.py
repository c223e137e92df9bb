"""Qwen2.5-Omni's thinker as a megatron model (omni25_bridge.py registers its bridge):
megatron-core's GPT language model in Qwen2's layout with sectioned M-RoPE (the provider is
megatron-bridge's Qwen2.5-VL one) holding the thinker's own vision and audio encoders, the HF
modules, replicated on every TP rank as the other towers are (vl.py, audio_model.py; or split,
trainer.towers=split: tower_split.py). The talker and token2wav are not built: RL trains the
thinker's text (modeling.NOT_SERVED).

The forward is transformers 5's Qwen2_5OmniThinkerModel.forward: audio features (the valid mel
frames of every audio, concatenated, through the encoder) at the `<|AUDIO|>` tokens, image and
video features at theirs, the TMRoPE positions by transformers' own
Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index (omni_rope.py: videos spaced
in time by `video_second_per_grid`, sampled start markers read as text; a video's sound is an
audio item after it, data.audio_from_video, not Qwen's interleaved `use_audio_in_video`
layout).

Imported only after cpu_compat.import_bridge (megatron-bridge needs transformer-engine or its
stub at import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.qwen_vl.qwen25_vl_provider import Qwen25VLModelProvider
from torch import Tensor
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder, Qwen2_5OmniVisionEncoder,
)

from relax_slurm.trainer.megatron import qwen2_parts, tower_split
from relax_slurm.trainer.megatron.omni_rope import omni25_rope_index


def thinker_audio(encoder, features: Tensor, feature_mask: Tensor) -> Tensor:
    """transformers' Qwen2_5OmniThinkerModel.get_audio_features: every audio's valid frames
    concatenated [mel, frames] through the encoder -> one embedding per audio token, in order."""
    lengths = feature_mask.sum(1)
    flat = features.permute(0, 2, 1)[feature_mask.bool()].permute(1, 0)
    after_cnn, _ = encoder._get_feat_extract_output_lengths(lengths)
    return encoder(flat.to(encoder.conv1.weight.dtype), feature_lens=lengths,
                   aftercnn_lens=after_cnn).last_hidden_state


class Omni25ThinkerModel(qwen2_parts.TowersModel):
    """megatron-core's GPT language model (`language_model`) with the thinker's vision encoder
    (`visual`) and audio encoder (`audio_tower`) under their HF names."""

    def __init__(self, config: "Omni25ThinkerProvider", pre_process: bool = True,
                 post_process: bool = True, vp_stage: Optional[int] = None) -> None:
        super().__init__(config, pre_process, post_process, vp_stage)
        thinker = config.thinker_config
        self.thinker_config = thinker
        self.image_token_id, self.video_token_id = thinker.image_token_id, thinker.video_token_id
        self.audio_token_id = thinker.audio_token_id
        self.visual = self.audio_tower = None
        if pre_process:
            self.visual = Qwen2_5OmniVisionEncoder._from_config(config.vision_config)
            self.audio_tower = Qwen2_5OmniAudioEncoder._from_config(config.audio_config)
            qwen2_parts.replicate((self.visual, self.audio_tower), config.params_dtype)
        self.build_language_model()

    def _vision(self, pixels: Tensor, grid: Tensor) -> tuple[Tensor, list[Tensor]]:
        return self.visual(pixels.to(self.visual.dtype), grid_thw=grid).pooler_output, []

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, labels: Tensor | None = None,
                pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                video_grid_thw=None, video_second_per_grid=None, input_features=None,
                feature_attention_mask=None, pad_mask: Tensor | None = None, **_) -> Tensor:
        """`pad_mask` [B, T] shapes the positions only (rows right-padded); `attention_mask`
        is the layers' causal mask."""
        emb = None
        if self.pre_process:
            split = tower_split.is_split(self.config)
            emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [T,B,H]
            visual = [(pixels, grid, token) for pixels, grid, token in (
                (pixel_values, image_grid_thw, self.image_token_id),
                (pixel_values_videos, video_grid_thw, self.video_token_id)) if pixels is not None]
            if input_features is not None or visual:  # text-only micro-batches: as embedded
                emb = emb.transpose(0, 1).clone()  # [B,T,H], indexed by the tokens' [B,T] masks
                if input_features is not None:
                    encode = tower_split.audio(
                        lambda f, m: thinker_audio(self.audio_tower, f, m), split)
                    emb[input_ids == self.audio_token_id] = encode(
                        input_features, feature_attention_mask).to(emb.dtype)
                tower = tower_split.vision(self._vision, split)
                for pixels, grid, token in visual:
                    emb[input_ids == token] = tower(pixels, grid)[0].to(emb.dtype)
                emb = emb.transpose(0, 1).contiguous()
            if self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                emb = tensor_parallel.scatter_to_sequence_parallel_region(emb).contiguous()
        if position_ids is None:
            lengths = None if feature_attention_mask is None else feature_attention_mask.sum(1)
            position_ids = omni25_rope_index(
                self.thinker_config, input_ids, pad_mask, image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw, audio_feature_lengths=lengths,
                second_per_grid=video_second_per_grid)
        return self.language_model(input_ids=None, position_ids=position_ids,
                                   attention_mask=attention_mask, decoder_input=emb,
                                   labels=labels)


@dataclass
class Omni25ThinkerProvider(Qwen25VLModelProvider):
    """Qwen2.5-VL's provider (Qwen2's language model with M-RoPE, embeddings not scattered
    before the media are placed) building the thinker."""

    audio_config: Any = None
    thinker_config: Any = None

    def provide(self, pre_process=None, post_process=None, vp_stage=None
                ) -> Omni25ThinkerModel:
        return Omni25ThinkerModel(
            self, pre_process=True if pre_process is None else pre_process,
            post_process=True if post_process is None else post_process, vp_stage=vp_stage)

    def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
        return GPTModelProvider.provide(self, pre_process=pre_process,
                                        post_process=post_process, vp_stage=vp_stage)
