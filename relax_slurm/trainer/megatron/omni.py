"""Qwen3-Omni (the thinker) under trainer=megatron.

megatron-bridge 0.3.1 has no Qwen3-Omni bridge; the project's is registered through the
bridge's public extension point (omni_bridge.py: the provider, every part's parameter mappings)
and builds omni_model.py's OmniThinkerModel: megatron-bridge's Qwen3-VL model (megatron-core's
MoE language model with interleaved M-RoPE and DeepStack) holding Qwen3-Omni's vision and audio
encoders as replicated HF modules, with a forward that places audio, image and video embeddings
and computes Omni's positions (omni_rope.py) as transformers does. The talker and code2wav are
neither built, trained nor sent (modeling.NOT_SERVED).
"""

from __future__ import annotations

MODEL_TYPE = "qwen3_omni_moe"
AUDIO_KEYS = ("input_features", "feature_attention_mask")
MEDIA_KINDS = frozenset({"image", "video", "audio"})


def register() -> None:
    """Registers the bridge with megatron-bridge's dispatch (once: a module import), before
    AutoBridge.from_hf_pretrained / from_hf_config of a Qwen3-Omni model (which validate the
    architecture against the registry). Imports megatron-bridge the CPU-safe way first."""
    from relax_slurm.trainer.megatron import cpu_compat

    cpu_compat.import_bridge()
    from relax_slurm.trainer.megatron import omni_bridge  # noqa: F401 - registers on import


def is_omni(hf_config) -> bool:
    return getattr(hf_config, "model_type", "") == MODEL_TYPE


def hf_prefix_to_megatron(prefix: str) -> str | None:
    """A `trainer.freeze_modules` prefix of the Omni thinker, in transformers' names or the
    files' (the preset's `thinker.audio_tower`, `thinker.visual`) -> the megatron model's;
    None if it is not one."""
    for hf, mg in (("thinker.model.visual", "vision_model"), ("thinker.visual", "vision_model"),
                   ("thinker.model.audio_tower", "audio_model"),
                   ("thinker.audio_tower", "audio_model"),
                   ("thinker.model.language_model", "language_model"),
                   ("thinker.lm_head", "language_model.output_layer")):
        if prefix == hf or prefix.startswith(hf + "."):
            return mg + prefix[len(hf):]
    return None
