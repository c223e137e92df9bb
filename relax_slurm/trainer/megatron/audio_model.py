"""Qwen2-Audio as a megatron model (audio_bridge.py registers its bridge): megatron-core's GPT
language model (Qwen2's: RMSNorm, gated SiLU MLP, QKV bias, 1-D RoPE) built by the provider,
with Qwen2-Audio's own audio encoder and projector, the HF modules, replicated on every TP
rank as the VL models' vision towers are (vl.py): each rank sees the same mel features and
gets the same gradient (the language model's column-parallel layers all-reduce their input
gradient over TP), and megatron's finalize averages these equal gradients over TP
(`average_gradients_across_tp_domain`, set by hook_hf_module_setattr_for_tp_grad_sync).

The forward is transformers 5's Qwen2AudioModel.forward (the processor expanded each audio to
its tokens): the encoder on the padded mel features with the bidirectional mask of each audio's
valid frames, the projector, each audio's valid outputs placed at its `<|AUDIO|>` tokens in
order; positions 0..T-1 (Qwen2's rotary embedding; rows are right-padded).

Imported only after cpu_compat.import_bridge (megatron-bridge needs transformer-engine or its
stub at import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.bridge.models.gpt_provider import GPTModelProvider
from torch import Tensor
from transformers.models.qwen2_audio.modeling_qwen2_audio import (
    Qwen2AudioEncoder, Qwen2AudioMultiModalProjector,
)

from relax_slurm.trainer.megatron import qwen2_parts, tower_split


def audio_embeddings(encoder, projector, features: Tensor, feature_mask: Tensor) -> Tensor:
    """Every audio's embeddings at its valid positions, concatenated in order [N, H]: the
    encoder on `features` [A, mel, frames] (padded to the encoder's window) with a mask of each
    audio's valid encoder frames, then the projector (transformers' Qwen2AudioModel.forward)."""
    from transformers.masking_utils import create_bidirectional_mask

    feat_lengths, out_lengths = encoder._get_feat_extract_output_lengths(feature_mask.sum(-1))
    A, _, mel_frames = features.shape
    frames = (mel_frames - 2) // 2 + 1
    valid = torch.arange(frames, device=features.device)[None, :] < feat_lengths[:, None]
    mask = create_bidirectional_mask(
        config=encoder.config, attention_mask=valid.long(),
        inputs_embeds=torch.zeros(A, frames, 1, dtype=encoder.conv1.weight.dtype,
                                  device=features.device))
    hidden = encoder(features.to(encoder.conv1.weight.dtype), attention_mask=mask)
    out = projector(hidden.last_hidden_state)
    keep = torch.arange(out.shape[1], device=out.device)[None, :] < out_lengths[:, None]
    return out[keep]


class Qwen2AudioMegatronModel(qwen2_parts.TowersModel):
    """megatron-core's GPT language model (`language_model`) with Qwen2-Audio's encoder
    (`audio_tower`) and projector (`multi_modal_projector`) under their HF names."""

    def __init__(self, config: "Qwen2AudioProvider", pre_process: bool = True,
                 post_process: bool = True, vp_stage: Optional[int] = None) -> None:
        super().__init__(config, pre_process, post_process, vp_stage)
        self.audio_token_id = config.audio_token_id
        self.audio_tower = self.multi_modal_projector = None
        if pre_process:
            self.audio_tower = Qwen2AudioEncoder._from_config(config.audio_config)
            self.multi_modal_projector = Qwen2AudioMultiModalProjector(config.hf_config)
            qwen2_parts.replicate((self.audio_tower, self.multi_modal_projector),
                                  config.params_dtype)
        self.build_language_model()

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, labels: Tensor | None = None,
                input_features: Tensor | None = None,
                feature_attention_mask: Tensor | None = None, **_) -> Tensor:
        emb = None
        if self.pre_process:
            emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [T,B,H]
            if input_features is not None:
                emb = emb.transpose(0, 1).clone()  # [B,T,H], indexed by the [B,T] mask
                encode = tower_split.audio(
                    lambda f, m: audio_embeddings(self.audio_tower, self.multi_modal_projector,
                                                  f, m), tower_split.is_split(self.config))
                emb[input_ids == self.audio_token_id] = encode(
                    input_features, feature_attention_mask).to(emb.dtype)
                emb = emb.transpose(0, 1).contiguous()
            if self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                emb = tensor_parallel.scatter_to_sequence_parallel_region(emb).contiguous()
        if position_ids is None:
            B, T = input_ids.shape
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
        return self.language_model(input_ids=None, position_ids=position_ids,
                                   attention_mask=attention_mask, decoder_input=emb,
                                   labels=labels)


@dataclass
class Qwen2AudioProvider(GPTModelProvider):
    """The language model's fields (Qwen2's, from the text config) plus the audio parts."""

    # the audio embeddings are placed before the sequence is split (forward above)
    scatter_embedding_sequence_parallel: bool = False
    audio_config: Any = None
    hf_config: Any = None  # the whole Qwen2AudioConfig: the projector's widths
    audio_token_id: int = 0

    def provide(self, pre_process=None, post_process=None, vp_stage=None
                ) -> Qwen2AudioMegatronModel:
        return Qwen2AudioMegatronModel(
            self, pre_process=True if pre_process is None else pre_process,
            post_process=True if post_process is None else post_process, vp_stage=vp_stage)

    def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
        return GPTModelProvider.provide(self, pre_process=pre_process,
                                        post_process=post_process, vp_stage=vp_stage)
