"""Which transformers class reads a model directory: causal LM, or multimodal (VL, audio, omni).

The engine and the trainer load the same class, so the parameter names the weight sync sends
are the names the engine loads.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MULTIMODAL_CONFIG_KEYS = ("vision_config", "audio_config", "thinker_config")
"""A config.json with one of these sub-configs is a multimodal model (Qwen2.5-VL, Qwen3-VL,
Qwen2-Audio, Qwen2.5-Omni / Qwen3-Omni)."""


def is_multimodal(path: str | Path) -> bool:
    """Whether the local model directory holds a multimodal model (no torch import)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    return any(k in json.loads(config.read_text()) for k in MULTIMODAL_CONFIG_KEYS)


def auto_model_class(path: str | Path) -> Any:
    """`AutoModelForMultimodalLM` for multimodal directories, else `AutoModelForCausalLM`."""
    from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM

    return AutoModelForMultimodalLM if is_multimodal(path) else AutoModelForCausalLM


def has_thinker(path: str | Path) -> bool:
    """Whether the directory holds an Omni model (Qwen2.5-Omni, Qwen3-Omni: a thinker_config),
    whose whole model has no forward: its thinker generates and trains (no torch import)."""
    config = Path(path) / "config.json"
    return config.is_file() and "thinker_config" in json.loads(config.read_text())


SPEECH_OUTPUT_KEY = "enable_audio_output"
"""Qwen3-Omni's (and Qwen2.5-Omni's) config switch that builds the speech talker and code2wav."""


def text_only_kwargs(path: str | Path) -> dict[str, Any]:
    """`from_pretrained` kwargs that leave a speech-output model's talker and code2wav unbuilt
    (`{"enable_audio_output": False}` for a Qwen3-Omni directory, else none): they produce no
    token the policy is trained on and are never sent (`NOT_SERVED`), so an engine serving the
    policy holds the thinker alone, as SGLang serves Qwen3-Omni's thinker."""
    config = Path(path) / "config.json"
    if config.is_file() and SPEECH_OUTPUT_KEY in json.loads(config.read_text()):
        return {SPEECH_OUTPUT_KEY: False}
    return {}


def text_model(model: Any) -> Any:
    """The module whose forward and `generate` give the policy's tokens: a Qwen3-Omni's (or
    Qwen2.5-Omni's) thinker, whose whole model has no forward and no output embeddings of its
    own; the model itself otherwise. Its parameters keep their names inside the whole model
    (`thinker.*`), which the weight sync uses."""
    thinker = getattr(model, "thinker", None)
    return thinker if thinker is not None else model


MEDIA_TOKEN_KEYS = ("image_token_id", "video_token_id", "audio_token_id", "image_token_index",
                    "video_token_index", "audio_token_index")


def media_token_ids(config: Any) -> tuple[int, ...]:
    """The pad tokens a multimodal config scatters media features into (empty for text models).

    They are input-only: the engine never samples them and the trainer's policy excludes them
    from its softmax, because a response holding one would be read as a media slot by the
    trainer's forward (the engine embeds it as text)."""
    def get(c: Any, key: str) -> Any:  # a config object, or config.json as a dict
        return c.get(key) if isinstance(c, Mapping) else getattr(c, key, None)

    ids = set()
    for c in (config, get(config, "thinker_config")):
        for key in MEDIA_TOKEN_KEYS:
            value = get(c, key) if c is not None else None
            if isinstance(value, int):
                ids.add(value)
    return tuple(sorted(ids))


def model_media_token_ids(path: str | Path) -> tuple[int, ...]:
    """`media_token_ids` of a model directory's config.json, read as JSON: no transformers
    config class, whose import brings torch (the rollout worker never imports it)."""
    config = Path(path) / "config.json"
    return media_token_ids(json.loads(config.read_text())) if config.is_file() else ()


# modality of each media pad, as transformers' processors number them (create_mm_token_type_ids)
_TOKEN_TYPES = {1: ("image_token_id", "image_token_index"),
                2: ("video_token_id", "video_token_index"),
                3: ("audio_token_id", "audio_token_index")}


def mm_token_types(model: Any, input_ids: Any, media: Mapping[str, Any]) -> dict[str, Any]:
    """`{"mm_token_type_ids": [B, L]}` (0 text, 1 image, 2 video, 3 audio pad) when the batch
    has media and the model's forward takes it, else `{}`.

    Qwen2/2.5/3-VL place media tokens by M-RoPE (3-D positions; videos spaced in time by
    `second_per_grid_ts`) only when given these types (their processors return them): without
    them Qwen2.5-VL falls back to text positions and Qwen3-VL refuses the batch. Padding is
    typed 0; the attention mask keeps it out of the positions."""
    if not media:
        return {}
    inner = getattr(model, "module", model)  # DDP
    if "mm_token_type_ids" not in _forward_params(type(inner)):
        return {}
    import torch

    types = torch.zeros_like(input_ids)
    for kind, keys in _TOKEN_TYPES.items():
        for key in keys:
            value = getattr(inner.config, key, None)
            if isinstance(value, int):
                types[input_ids == value] = kind
    return {"mm_token_type_ids": types}


@functools.cache
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


NOT_SERVED = ("talker.", "code2wav.", "token2wav.")
"""Top-level parts of a model that produce no token the policy is trained on, never sent to the
engines: Qwen3-Omni's speech talker and code-to-waveform decoder, Qwen2.5-Omni's talker and
token2wav. RL trains the thinker's text; these get no gradient and never change, and SGLang's
loader drops them anyway unless it serves speech (`qwen3_omni_moe.py`: `if ("talker" in name
or "code2wav" in name) and not self.enable_talker: continue`): every sync broadcast them for
nothing."""


FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")
"""transformers 5 keeps an MoE layer's experts fused in memory (Qwen2/3-MoE, Qwen3-Omni's
thinker, DeepSeek, ...: `experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) while
the checkpoint files, SGLang's loader and megatron-bridge's export name them per expert."""


def checkpoint_names(model: Any) -> dict[str, str]:
    """Checkpoint-file name -> parameter name where they differ by a renaming only.

    transformers 5 loads some models under new names (Qwen2.5-VL: `model.language_model.*`,
    `model.visual.*`) from files written with the old ones (`model.*`, `visual.*`), and saves
    them back under the old ones, by its conversion mapping. Trainers exporting checkpoint
    names (megatron-bridge) and SGLang use the old ones; this is transformers' own reversal
    (`revert_weight_conversion`, as `save_pretrained` applies it), kept where it renames a
    parameter without converting it. Computed once per model."""
    cached = getattr(model, "_relax_checkpoint_names", None)
    if cached is not None:
        return cached
    out: dict[str, str] = {}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: loads under the checkpoint's names
        revert_weight_conversion = None
    if revert_weight_conversion is not None:
        params = dict(model.named_parameters(remove_duplicate=False))
        by_id = {}
        for name, p in params.items():
            by_id.setdefault(id(p), name)
        try:
            reverted = revert_weight_conversion(model, dict(params))
        except Exception:  # noqa: BLE001 - no alias names rather than no engine
            reverted = {}
        for name, t in reverted.items():
            if name not in params and id(t) in by_id:
                out[name] = by_id[id(t)]
        # fused experts are converted (split per expert), not renamed, so no reverted tensor
        # is theirs: give their stem the renaming of the module they sit in (Qwen3-Omni:
        # `thinker.model.language_model.layers.0.mlp.experts.gate_up_proj` is filed under
        # `thinker.model.layers.0.mlp.experts`, which checkpoint_views splits per expert)
        rules = _prefix_renames(out)
        for name in params:
            if name.endswith(FUSED_EXPERTS) and name not in out.values():
                file_name = _renamed(name, rules)
                if file_name != name:
                    out[file_name] = name
    try:
        model._relax_checkpoint_names = out
    except AttributeError:
        pass
    return out


def _prefix_renames(names: Mapping[str, str]) -> list[tuple[str, str]]:
    """(in-memory prefix, file prefix) of each renaming in `names` (file -> memory), longest
    first: what is left of both names once their common dotted tail is taken off."""
    rules = set()
    for file_name, name in names.items():
        f, n = file_name.split("."), name.split(".")
        while f and n and f[-1] == n[-1]:
            f.pop()
            n.pop()
        rules.add((".".join(n) + "." if n else "", ".".join(f) + "." if f else ""))
    return sorted(rules, key=lambda r: -len(r[0]))


def _renamed(name: str, rules: list[tuple[str, str]]) -> str:
    for memory, file in rules:
        if memory and name.startswith(memory):
            return file + name[len(memory):]
    return name


def checkpoint_views(name: str, tensor: Any) -> list[tuple[str, Any]]:
    """A parameter under the names of the checkpoint files: itself, or for a fused experts
    tensor one view per expert (`experts.{e}.gate_proj.weight` = gate_up_proj[e, :I],
    `up_proj` = [e, I:], `down_proj` = down_proj[e]), contiguous, sharing its memory, so a
    weight update received into them lands in the fused tensor. SGLang loads the same names."""
    if tensor.dim() != 3 or not name.endswith(FUSED_EXPERTS):
        return [(name, tensor)]
    stem, kind = name.rsplit(".", 1)
    if kind == "down_proj":
        return [(f"{stem}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    half = tensor.shape[1] // 2
    return [view for e in range(tensor.shape[0])
            for view in ((f"{stem}.{e}.gate_proj.weight", tensor[e, :half]),
                         (f"{stem}.{e}.up_proj.weight", tensor[e, half:]))]


def checkpoint_shapes(gate_up: bool, experts: int, hidden: int, ffn: int
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(Qwen's released layout, transformers 5's in-memory layout) of one fused expert tensor
    of a Qwen3-VL-MoE file: gate_up_proj [E, H, 2I] / [E, 2I, H], down_proj [E, I, H] /
    [E, H, I]. transformers 5 transposes Qwen's on load (its conversion mapping) and its
    `save_pretrained` of a model it built writes its own."""
    if gate_up:
        return (experts, hidden, 2 * ffn), (experts, 2 * ffn, hidden)
    return (experts, ffn, hidden), (experts, hidden, ffn)


def experts_in_transformers_layout(path: str | Path, config: dict | None = None) -> str | None:
    """The first fused expert tensor of a Qwen3-VL-MoE directory's safetensors that is in
    transformers 5's layout and not Qwen's (read from the headers), or None. SGLang 0.5.2x's
    Qwen3-VL-MoE loads only Qwen's layout (models/qwen3_vl_moe.py transposes what it reads).
    `config`: its config.json when the caller has read it."""
    if config is None:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            return None
        config = json.loads(config_path.read_text())
    text = config.get("text_config") or {}
    if "Qwen3VLMoeForConditionalGeneration" not in (config.get("architectures") or []) \
            or "moe_intermediate_size" not in text:
        return None
    from relax_slurm.checkpoint.hf_files import weight_shapes

    for name, shape in sorted(weight_shapes(Path(path)).items()):
        if name.endswith(FUSED_EXPERTS):
            qwen, hf = checkpoint_shapes(name.endswith(FUSED_EXPERTS[0]), shape[0],
                                         text["hidden_size"], text["moe_intermediate_size"])
            if shape == hf and hf != qwen:
                return name
    return None
