"""The project's own megatron-bridge bridges, for models megatron-bridge 0.3.1 has none for:
Qwen3-Omni's thinker (omni_bridge.py), Qwen2.5-Omni's (omni25_bridge.py) and Qwen2-Audio
(audio_bridge.py). Each registers with megatron-bridge's dispatch when its module is
imported."""

from __future__ import annotations


def register() -> None:
    """Registers them (once: module imports), before AutoBridge.from_hf_pretrained /
    from_hf_config of such a model (which validate the architecture against the registry).
    Imports megatron-bridge the CPU-safe way first."""
    from relax_slurm.trainer.megatron import cpu_compat

    cpu_compat.import_bridge()
    from relax_slurm.trainer.megatron import (  # noqa: F401 - register
        audio_bridge, omni25_bridge, omni_bridge,
    )
