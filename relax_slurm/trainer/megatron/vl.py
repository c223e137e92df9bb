"""Multimodal models under trainer=megatron: Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (its
experts: vl_moe.py), built by megatron-bridge 0.3.1 (megatron/bridge/models/qwen_vl/); the
Qwen3-Omni and Qwen2.5-Omni thinkers and Qwen2-Audio by the project's bridges (omni_*.py,
omni25_*.py, audio_*.py).

The bridge's VL code was written against transformers 4 and for transformer-engine; `apply()`
installs small overrides, each naming the upstream line it works around (idempotent). The
vision tower is megatron-bridge's wrapper of the HF module, replicated on every TP rank: it
sees the same pixels and receives the same gradient (the language model's column-parallel
layers all-reduce their input gradient over TP), so its weights stay equal across TP; the
language model is megatron-core's GPTModel with TP (docs/backends.md).
"""

from __future__ import annotations

import types

import torch
from torch import Tensor

from relax_slurm.errors import ConfigError
from relax_slurm.trainer.megatron import omni_names, tower_split, vl_moe

QWEN25 = "qwen2_5_vl"
QWEN3 = "qwen3_vl"
QWEN3_MOE = "qwen3_vl_moe"  # experts: vl_moe.py
OMNI = omni_names.MODEL_TYPE  # Qwen3-Omni's thinker: omni.py
AUDIO = "qwen2_audio"  # Qwen2-Audio: audio_model.py
OMNI25 = "qwen2_5_omni"  # Qwen2.5-Omni's thinker: omni25_model.py
SUPPORTED = (QWEN25, QWEN3, QWEN3_MOE, OMNI, AUDIO, OMNI25)


def kind(hf_config) -> str | None:
    """QWEN25/QWEN3/QWEN3_MOE/OMNI/AUDIO/OMNI25 for a supported multimodal model, None for a
    text decoder; ConfigError for a multimodal model trainer=megatron cannot train."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type in SUPPORTED:
        return model_type
    if (getattr(hf_config, "vision_config", None) is not None or hasattr(hf_config, "audio_config")
            or hasattr(hf_config, "thinker_config")):
        raise ConfigError(
            "trainer=megatron trains Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3-Omni, "
            "Qwen2.5-Omni and Qwen2-Audio among "
            f"multimodal models, not model_type={model_type!r}. Fix: trainer=torch "
            "(docs/backends.md#multimodal-models)")
    return None


_APPLIED = False


def apply() -> None:
    """The overrides (once per process)."""
    global _APPLIED
    if _APPLIED:
        return
    from relax_slurm.trainer.megatron import cpu_compat

    if cpu_compat.needed():
        cpu_compat.local_vl_layer_specs()
    _qwen25_provider()
    _qwen25_forward()
    _qwen3_vision_tuple()
    _qwen3_rope_alias()
    _qwen3_forward()
    vl_moe.apply()
    _APPLIED = True


def _qwen25_provider() -> None:
    """qwen_vl/qwen25_vl_bridge.py:52 reads the text model's fields from the top-level config
    (`text_config = hf_config`); transformers 5 keeps them only in `text_config` (the provider
    got no layers/heads: ZeroDivisionError in finalize). The bridge's own provider_bridge run on
    a view whose attributes fall back from the top-level config to the text config."""
    from megatron.bridge.models.qwen_vl import qwen25_vl_bridge as qb

    original = qb.Qwen25VLBridge.provider_bridge

    class _Merged:
        def __init__(self, top, text):
            self._top, self._text = top, text

        def __getattr__(self, name):
            value = getattr(self._top, name, None)
            return value if value is not None else getattr(self._text, name)

    def provider_bridge(self, hf_pretrained):
        cfg = hf_pretrained.config
        view = types.SimpleNamespace(config=_Merged(cfg, cfg.text_config))
        provider = original(self, view)
        provider.share_embeddings_and_output_weights = bool(cfg.tie_word_embeddings)
        provider.mrope_section = list(cfg.text_config.rope_parameters["mrope_section"])
        return provider

    qb.Qwen25VLBridge.provider_bridge = provider_bridge


def _qwen25_forward() -> None:
    """qwen_vl/modeling_qwen25_vl.py Qwen25VLModel.forward calls transformers 4's
    `get_image_features` (transformers 5 returns a ModelOutput), the old `get_rope_index`
    signature (transformers 5 takes `mm_token_type_ids` second) and a
    `get_vision_position_ids` it never binds, and drops videos. The same computation with
    transformers 5's API, as its Qwen2_5_VLModel.forward does it: image and video features (the
    one vision tower's pooler_output) placed at the image and video tokens, M-RoPE positions
    (videos spaced in time by `second_per_grid_ts`) from transformers' own get_rope_index, then
    megatron's language model."""
    from megatron.bridge.models.qwen_vl.modeling_qwen25_vl import Qwen25VLModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    def forward(self, input_ids, position_ids=None, attention_mask=None, pixel_values=None,
                image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
                second_per_grid_ts=None, mm_token_type_ids=None, pad_mask=None, **_):
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [T,B,H]
        if pixel_values is not None or pixel_values_videos is not None:
            emb = emb.transpose(0, 1).clone()  # [B,T,H], indexed by the tokens' [B,T] mask
            tower = tower_split.vision(
                lambda pixels, grid: (self.visual(pixels, grid_thw=grid).pooler_output, []),
                tower_split.is_split(self.config))
            if pixel_values is not None:
                features, _ = tower(pixel_values, image_grid_thw)
                emb[input_ids == self.config.image_token_id] = features.to(emb.dtype)
            if pixel_values_videos is not None:
                features, _ = tower(pixel_values_videos, video_grid_thw)
                emb[input_ids == self.config.video_token_id] = features.to(emb.dtype)
            emb = emb.transpose(0, 1).contiguous()
        if position_ids is None:
            shim = types.SimpleNamespace(config=self.config)
            shim.get_vision_position_ids = types.MethodType(
                Qwen2_5_VLModel.get_vision_position_ids, shim)
            if mm_token_type_ids is None:
                mm_token_type_ids = token_types(self.config, input_ids)
            position_ids, _ = Qwen2_5_VLModel.get_rope_index(
                shim, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw,
                second_per_grid_ts, attention_mask=pad_mask)
        return self.language_model(input_ids=None, position_ids=position_ids,
                                   attention_mask=attention_mask, decoder_input=emb)

    Qwen25VLModel.forward = forward


def token_types(config, input_ids: Tensor) -> Tensor:
    """transformers' `mm_token_type_ids` for Qwen2.5-VL rows: 0 text, 1 image, 2 video token."""
    types_ = torch.zeros_like(input_ids)
    types_[input_ids == config.image_token_id] = 1
    types_[input_ids == config.video_token_id] = 2
    return types_


def _qwen3_vision_tuple() -> None:
    """qwen_vl/modelling_qwen3_vl/model.py:273 unpacks the vision tower's output as
    (embeddings, deepstack features); transformers 5's tower returns a ModelOutput."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as m

    base = m.Qwen3VLVisionModelHF
    if getattr(base, "_relax_tuple", False):
        return

    class Vision(base):
        _relax_tuple = True

        def forward(self, hidden_states, grid_thw, **kw):
            out = super().forward(hidden_states, grid_thw=grid_thw, return_dict=True, **kw)
            return out.pooler_output, out.deepstack_features

    Vision.__name__ = Vision.__qualname__ = base.__name__
    m.Qwen3VLVisionModelHF = Vision


def _qwen3_rope_alias() -> None:
    """qwen_vl/modelling_qwen3_vl/rope.py:58,89 call `apply_interleaved_mrope`, a method of
    transformers 4's Qwen3-VL rotary embedding that transformers 5 renamed away; the same
    interleaving (frequency i of the head carries t, h, w in turn per mrope_section)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextRotaryEmbedding,
    )

    def apply_interleaved_mrope(self, freqs, mrope_section):
        out = freqs[0]
        for dim, offset in enumerate((1, 2), start=1):
            idx = slice(offset, mrope_section[dim] * 3, 3)
            out[..., idx] = freqs[dim, ..., idx]
        return out

    for cls in (Qwen3VLTextRotaryEmbedding, Qwen3VLMoeTextRotaryEmbedding):
        if not hasattr(cls, "apply_interleaved_mrope"):
            cls.apply_interleaved_mrope = apply_interleaved_mrope


def _qwen3_forward() -> None:
    """qwen_vl/modelling_qwen3_vl/model.py:248,298 assert no video ("not support video now"),
    and its get_rope_index (utils.py:131-132) reads the token after every <|vision_start|>:
    out of range when a sampled response ends with one (IndexError in training). The same
    computation as transformers 5's Qwen3VLModel.forward: the vision tower run on the images
    and on the videos, each one's features placed at its pad tokens, the DeepStack features of
    both merged in sequence order (`visual_pos_masks`), M-RoPE positions by transformers' own
    get_rope_index (videos frame by frame, as their timestamps separate them), then megatron's
    language model (split over the sequence under sequence parallelism, as the bridge does)."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as m
    from megatron.core import tensor_parallel

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None,
                pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                video_grid_thw=None, pad_mask=None, **_):
        cfg = self.config
        emb = visual_mask = deepstack = None
        if self.pre_process:
            emb = self.language_model.embedding(input_ids=input_ids, position_ids=None).clone()
            items = [(pixels, grid, input_ids == token) for pixels, grid, token in (
                (pixel_values, image_grid_thw, self.image_token_id),
                (pixel_values_videos, video_grid_thw, self.video_token_id)) if pixels is not None]
            if items:
                emb = emb.transpose(0, 1).contiguous()  # [B,T,H], indexed by the [B,T] masks
                emb, visual_mask, deepstack = merge_vision(emb, items, tower_split.vision(
                    lambda pixels, grid: self.vision_model(hidden_states=pixels, grid_thw=grid),
                    tower_split.is_split(cfg)))
                emb = emb.transpose(0, 1).contiguous()
            if cfg.sequence_parallel:
                emb = tensor_parallel.scatter_to_sequence_parallel_region(emb).contiguous()
        if position_ids is None:
            position_ids, _ = qwen3_rope_index(
                cfg.spatial_merge_size, self.image_token_id, input_ids, image_grid_thw,
                pad_mask, video_token_id=self.video_token_id, video_grid_thw=video_grid_thw)
        return language_forward(self, emb, position_ids, attention_mask, labels, visual_mask,
                                deepstack)

    m.Qwen3VLModel.forward = forward


def language_forward(model, emb: Tensor | None, position_ids: Tensor, attention_mask, labels,
                     visual_mask: Tensor | None, deepstack: list[Tensor] | None):
    """The language model's half of a Qwen3-VL-style forward (Qwen3-VL(-MoE), the Qwen3-Omni
    thinker): the embeddings with the media placed, DeepStack features added at their tokens
    (this TP rank's slice of them under sequence parallelism)."""
    if model.config.sequence_parallel and visual_mask is not None:
        visual_mask, deepstack = split_deepstack(visual_mask, deepstack)
    return model.language_model(
        input_ids=None, position_ids=position_ids, attention_mask=attention_mask,
        decoder_input=emb, labels=labels, visual_pos_masks=visual_mask,
        deepstack_visual_embeds=deepstack)


def split_deepstack(visual_mask: Tensor, deepstack: list[Tensor]
                    ) -> tuple[Tensor, list[Tensor]]:
    """Under sequence parallelism, this TP rank's slice of the visual tokens and of their
    DeepStack features (the bridge's split_deepstack_embs), with a backward that gives the
    replicated vision tower the whole sequence's DeepStack gradient on every rank: each rank
    adds only its slice, and megatron's finalize averages the tower's gradients over TP, so
    without the all-reduce (copy_to_tensor_model_parallel_region: identity forward) the
    tower's gradient lost half the DeepStack part at TP=2 (measured 30% of the patch
    embedding's gradient for the tiny Qwen3-VL-MoE)."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as m
    from megatron.core import mpu, tensor_parallel

    deepstack = [tensor_parallel.copy_to_tensor_model_parallel_region(d) for d in deepstack]
    return m.split_deepstack_embs(visual_mask, deepstack,
                                  tp_size=mpu.get_tensor_model_parallel_world_size(),
                                  tp_rank=mpu.get_tensor_model_parallel_rank())


def merge_vision(emb: Tensor, items, tower) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Qwen3-VL's / Qwen3-Omni's vision features placed in `emb` [B, T, H] (in place): `items`
    (pixels, grid_thw, [B, T] pad mask) of images and of videos, `tower(pixels, grid)` ->
    (features, DeepStack features per layer). Returns emb, the mask of all visual tokens and
    the DeepStack features of both merged in sequence order (as transformers does)."""
    visual_mask = torch.zeros_like(items[0][2], dtype=torch.bool)
    for _p, _g, mask in items:
        visual_mask |= mask
    stacks = []
    for pixels, grid, mask in items:
        features, stack = tower(pixels, grid)
        emb[mask] = features.to(emb.dtype)
        stacks.append((mask[visual_mask], stack))
    deepstack = []
    for layer in range(len(stacks[0][1])):
        joint = emb.new_zeros(int(visual_mask.sum()), emb.shape[-1])
        for where, stack in stacks:
            joint[where] = stack[layer].to(joint.dtype)
        deepstack.append(joint)
    return emb, visual_mask, deepstack


def qwen3_rope_index(spatial_merge_size: int, image_token_id: int, input_ids: Tensor,
                     image_grid_thw: Tensor | None, attention_mask: Tensor | None = None, *,
                     video_token_id: int | None = None, video_grid_thw: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
    """Qwen3-VL's M-RoPE positions [3, B, T] (and per-row deltas) for right-padded rows with
    images and videos, by transformers 5's Qwen3VLModel.get_rope_index (images: runs of
    image_token_id; a video: one run of video_token_id per frame, its grid's t runs)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as HF

    shim = types.SimpleNamespace(config=types.SimpleNamespace(
        vision_config=types.SimpleNamespace(spatial_merge_size=spatial_merge_size)))
    shim.get_vision_position_ids = types.MethodType(HF.get_vision_position_ids, shim)
    mm_types = (input_ids == image_token_id).long()
    if video_grid_thw is not None:
        mm_types[input_ids == video_token_id] = 2
        video_grid_thw = video_grid_thw.clone()  # transformers splits it per frame in place
    if attention_mask is not None and attention_mask.dim() != 2:
        attention_mask = None  # the layers' mask: rows are right-padded
    return HF.get_rope_index(shim, input_ids, mm_types, image_grid_thw, video_grid_thw,
                             attention_mask=attention_mask)


IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def media_keys(model_kind: str) -> tuple[str, ...]:
    """The media tensors a VL kind's megatron forward takes: images and videos (Qwen3-VL
    spaces frames by timestamps in the text: no second_per_grid_ts); Qwen3-Omni also audio;
    Qwen2-Audio audio alone."""
    if model_kind == AUDIO:
        return omni_names.AUDIO_KEYS
    if model_kind in (OMNI, OMNI25):  # the thinkers' name for the seconds (data/processor.py)
        return IMAGE_KEYS + VIDEO_KEYS[:2] + ("video_second_per_grid",) + omni_names.AUDIO_KEYS
    return IMAGE_KEYS + (VIDEO_KEYS if model_kind == QWEN25 else VIDEO_KEYS[:2])


def check_media(model_kind: str, media_kinds) -> None:
    """ConfigError when the run's `data.multimodal_keys` has media this model's megatron
    forward does not take (audio: the Omni thinkers' and Qwen2-Audio's only; Qwen2-Audio takes
    nothing else). The config admits image, video and audio (cross_checks.py); this runs once
    the model's kind is known."""
    takes = {OMNI: omni_names.MEDIA_KINDS, OMNI25: omni_names.MEDIA_KINDS,
             AUDIO: {"audio"}}.get(model_kind, {"image", "video"})
    unknown = set(media_kinds) - takes
    if unknown:
        raise ConfigError(
            f"trainer=megatron feeds {model_kind} {' and '.join(sorted(takes))}, not "
            f"{sorted(unknown)} (data.multimodal_keys; audio: Qwen3-Omni, Qwen2.5-Omni and "
            "Qwen2-Audio only). Fix: trainer=torch (docs/backends.md#multimodal-models)")


def forward(model_kind: str, chunk, input_ids: Tensor, attention_mask: Tensor | None,
            media: dict[str, Tensor]) -> Tensor:
    """One VL chunk's vocab-parallel logits [B, T, V/TP] for right-padded rows with media."""
    T = input_ids.shape[1]
    known = media_keys(model_kind)
    unknown = set(media) - set(known)
    if unknown:
        raise ConfigError(f"trainer=megatron cannot feed {sorted(unknown)} to {model_kind}. "
                          "Fix: trainer=torch (docs/backends.md#multimodal-models)")
    kw = {k: media[k] for k in known if k in media}
    if model_kind == AUDIO:  # 1-D RoPE: positions 0..T-1, the causal mask the whole mask
        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).triu(1)
        return chunk(input_ids=input_ids, attention_mask=causal.view(1, 1, T, T), **kw)
    if model_kind in (QWEN25, OMNI25):  # Qwen2's language model: the causal mask given
        pad = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).triu(1)
        if model_kind == QWEN25:
            kw["mm_token_type_ids"] = token_types(chunk_config(chunk), input_ids)
        return chunk(input_ids=input_ids, attention_mask=causal.view(1, 1, T, T),
                     pad_mask=pad, **kw)
    # Qwen3-VL (_qwen3_forward) and Qwen3-Omni (omni_model.py): no mask means the layers'
    # causal mask (rows right-padded); the padding only shapes the M-RoPE positions
    return chunk(input_ids=input_ids, attention_mask=None, pad_mask=attention_mask, **kw)


def chunk_config(chunk):
    """The megatron model's config under its DDP / float16 wrappers."""
    inner = chunk
    while hasattr(inner, "module"):
        inner = inner.module
    return inner.config


def hf_prefix_to_megatron(model_kind: str, prefix: str) -> str:
    """A `trainer.freeze_modules` prefix in HF names (model.visual, model.language_model...)
    -> the megatron model's parameter prefix."""
    if model_kind == OMNI:
        return omni_names.hf_prefix_to_megatron(prefix) or prefix
    if model_kind == OMNI25:  # the towers keep their HF names (omni25_bridge.py)
        return omni_names.hf_prefix_to_megatron(
            prefix, {"visual": "visual", "audio_tower": "audio_tower"}) or prefix
    if model_kind == AUDIO:  # transformers 5's names in memory, and the files' names
        pairs = (("model.audio_tower", "audio_tower"),
                 ("model.multi_modal_projector", "multi_modal_projector"),
                 ("model.language_model", "language_model"),
                 ("language_model.model", "language_model"),
                 ("language_model.lm_head", "language_model.output_layer"),
                 ("lm_head", "language_model.output_layer"))
        return next((mg + prefix[len(hf):] for hf, mg in pairs
                     if prefix == hf or prefix.startswith(hf + ".")), prefix)
    vision = "visual" if model_kind == QWEN25 else "vision_model"
    for hf, mg in (("model.visual", vision), ("visual", vision),
                   ("model.language_model", "language_model"),
                   ("lm_head", "language_model.output_layer")):
        if prefix == hf or prefix.startswith(hf + "."):
            return mg + prefix[len(hf):]
    return prefix
