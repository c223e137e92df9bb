"""The Omni thinkers' M-RoPE positions for trainer=megatron (omni_model.py's forward,
Qwen3-Omni; omni25_model.py's, Qwen2.5-Omni, by its own transformers function, the same rules).

The positions are transformers 5's own `get_rope_index` of Qwen3-Omni (run on a shim holding
only the thinker's config), so they are the reference's by construction: text runs count by one;
an image or a video takes a (t, h, w) grid after its <|vision_start|>, a video's t spaced by
`second_per_grid * position_id_per_seconds`; an audio a run of 1-D positions after its
<|audio_start|> whose length the audio encoder's downsampling gives. Two quirks of the reference
are kept, because the engines and trainer=torch compute the same: without any image or video in
the batch every row gets plain text positions (audio too), and the positions are float.

A start marker the policy sampled (a response may hold `<|audio_start|>` or `<|vision_start|>`:
only the media pads are never sampled) is text here, as it is to the engine, which placed its
media once in the prompt's prefill and counts every generated token by one. transformers'
`get_rope_index` counts every <|audio_start|> of a row as an audio and reads the token after
every <|vision_start|>: on the tiny Qwen3-Omni's first end-to-end run a sampled audio marker
took the next row's audio length and the positions ran backwards (RuntimeError in
`torch.arange`), and a marker sampled last is read past the row's end. So a marker not followed
by its pads is renamed (-1, no token of the model) in the ids the positions are computed from.
"""

from __future__ import annotations

import types

from torch import Tensor


def omni_rope_index(thinker_config, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                    image_grid_thw: Tensor | None = None, video_grid_thw: Tensor | None = None,
                    audio_feature_lengths: Tensor | None = None,
                    second_per_grid: Tensor | None = None) -> Tensor:
    """M-RoPE positions [3, B, T] (float) of right-padded rows.

    `attention_mask` [B, T] (1 on the rows' tokens; None: no padding), `audio_feature_lengths`
    [n_audio] the valid mel frames of each audio (feature_attention_mask.sum(1)),
    `second_per_grid` [n_video] seconds per temporal patch of each video."""
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoePreTrainedModelForConditionalGeneration as HF,
    )

    if attention_mask is None or attention_mask.dim() != 2:
        attention_mask = torch.ones_like(input_ids)  # megatron's layers' mask: rows unpadded
    shim = types.SimpleNamespace(config=thinker_config,
                                 spatial_merge_size=thinker_config.vision_config.spatial_merge_size)
    shim.get_llm_pos_ids_for_vision = types.MethodType(HF.get_llm_pos_ids_for_vision, shim)
    positions, _ = HF.get_rope_index(
        shim, media_markers_only(thinker_config, input_ids), image_grid_thw, video_grid_thw,
        attention_mask,
        use_audio_in_video=False, audio_seqlens=audio_feature_lengths,
        second_per_grids=second_per_grid)
    return positions


def media_markers_only(thinker_config, input_ids: Tensor) -> Tensor:
    """`input_ids` [B, T] with every start marker that is not followed by its media's pads
    (an image's or a video's after <|vision_start|>, an audio's after <|audio_start|>) set to
    -1, so transformers' position code reads it as text (module docstring)."""
    import torch

    c = thinker_config
    after = torch.full_like(input_ids, -1)
    after[:, :-1] = input_ids[:, 1:]
    vision = (after == c.image_token_id) | (after == c.video_token_id)
    unpaired = (((input_ids == c.vision_start_token_id) & ~vision)
                | ((input_ids == c.audio_start_token_id) & (after != c.audio_token_id)))
    return input_ids.masked_fill(unpaired, -1) if bool(unpaired.any()) else input_ids


def omni25_rope_index(thinker_config, input_ids: Tensor, attention_mask: Tensor | None = None,
                      *, image_grid_thw: Tensor | None = None,
                      video_grid_thw: Tensor | None = None,
                      audio_feature_lengths: Tensor | None = None,
                      second_per_grid: Tensor | None = None) -> Tensor:
    """Qwen2.5-Omni's thinker's TMRoPE positions [3, B, T] of right-padded rows, by transformers'
    Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index (the arguments as
    `omni_rope_index`'s; sampled start markers read as text the same way)."""
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniPreTrainedModelForConditionalGeneration as HF,
    )

    if attention_mask is None or attention_mask.dim() != 2:
        attention_mask = torch.ones_like(input_ids)
    shim = types.SimpleNamespace(config=thinker_config,
                                 spatial_merge_size=thinker_config.vision_config.spatial_merge_size)
    for name in ("get_llm_pos_ids_for_vision", "get_chunked_index"):
        setattr(shim, name, types.MethodType(getattr(HF, name), shim))
    positions, _ = HF.get_rope_index(
        shim, media_markers_only(thinker_config, input_ids), image_grid_thw, video_grid_thw,
        attention_mask, use_audio_in_video=False, audio_seqlens=audio_feature_lengths,
        second_per_grids=second_per_grid)
    return positions
