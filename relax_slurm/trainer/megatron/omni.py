"""Qwen3-Omni (the thinker) under trainer=megatron; the export's config of both Omni models
(Qwen2.5-Omni's thinker: omni25_*.py).

megatron-bridge 0.3.1 has no Qwen3-Omni bridge; the project's is registered through the
bridge's public extension point (bridges.register, omni_bridge.py: the provider, every part's parameter mappings)
and builds omni_model.py's OmniThinkerModel: megatron-bridge's Qwen3-VL model (megatron-core's
MoE language model with interleaved M-RoPE and DeepStack) holding Qwen3-Omni's vision and audio
encoders as replicated HF modules, with a forward that places audio, image and video embeddings
and computes Omni's positions (omni_rope.py) as transformers does. The talker and code2wav are
neither built, trained nor sent (modeling.NOT_SERVED).
"""

from __future__ import annotations

# the pure names (vl.py reads them too; bridges.register() reaches vl.py through
# omni_bridge -> omni_model, so vl.py imports omni_names, not omni_bridge)
from relax_slurm.trainer.megatron.omni_names import (  # noqa: F401 - re-exported
    AUDIO_KEYS, MEDIA_KINDS, MODEL_TYPE, hf_prefix_to_megatron,
)


OMNI_MODEL_TYPES = (MODEL_TYPE, "qwen2_5_omni")  # Qwen3-Omni, Qwen2.5-Omni (omni25_*.py)


def is_omni(hf_config) -> bool:
    return getattr(hf_config, "model_type", "") in OMNI_MODEL_TYPES


def thinker_only_config(hf_config):
    """The config an HF export of the megatron model is written with: an Omni model's says
    `enable_audio_output: false`, since the export holds the thinker alone (the talker and
    code2wav / token2wav are never built here), so transformers loads the directory as it is
    instead of initialising a random talker; other models' config unchanged. Copy the
    original's `talker.*` and `code2wav.*` (`token2wav.*`) tensors in and set it back to true
    for speech output."""
    import copy

    if not is_omni(hf_config) or not getattr(hf_config, "enable_audio_output", False):
        return hf_config
    out = copy.deepcopy(hf_config)
    out.enable_audio_output = False
    return out
