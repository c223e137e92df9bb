"""Qwen3-Omni's names under trainer=megatron, without imports: its model type, the audio
tensors its forward takes, the media kinds it reads, and `trainer.freeze_modules` prefixes.
Read by vl.py and re-exported by omni.py (whose register() imports omni_bridge, which reaches
vl.py through omni_model.py: vl.py importing omni.py made a file circle).
"""

from __future__ import annotations

MODEL_TYPE = "qwen3_omni_moe"
AUDIO_KEYS = ("input_features", "feature_attention_mask")
MEDIA_KINDS = frozenset({"image", "video", "audio"})


TOWERS = {"visual": "vision_model", "audio_tower": "audio_model"}
"""The thinker's towers (HF name -> the megatron model's): Qwen3-Omni's (omni_model.py);
Qwen2.5-Omni's keep their HF names (omni25_model.py)."""


def hf_prefix_to_megatron(prefix: str, towers: dict[str, str] = TOWERS) -> str | None:
    """A `trainer.freeze_modules` prefix of an Omni thinker, in transformers' names or the
    files' (the preset's `thinker.audio_tower`, `thinker.visual`) -> the megatron model's;
    None if it is not one."""
    for hf, mg in (("thinker.model.visual", towers["visual"]),
                   ("thinker.visual", towers["visual"]),
                   ("thinker.model.audio_tower", towers["audio_tower"]),
                   ("thinker.audio_tower", towers["audio_tower"]),
                   ("thinker.model.language_model", "language_model"),
                   ("thinker.lm_head", "language_model.output_layer")):
        if prefix == hf or prefix.startswith(hf + "."):
            return mg + prefix[len(hf):]
    return None
