"""trainer=megatron with vision-language models: what the config allows and refuses, and
`trainer.freeze_modules` in HF names mapped onto the megatron model's parameters
(relax_slurm/trainer/megatron/vl.py). The models themselves:
tests/integration/test_megatron_vl.py."""

from __future__ import annotations

import pytest
import torch
from transformers import (Qwen2_5OmniConfig, Qwen2AudioConfig, Qwen3OmniMoeConfig,
                          Qwen3VLMoeConfig)

from relax_slurm.data.processor import video_seconds_key
from relax_slurm.errors import ConfigError
from relax_slurm.launch.submit import compose_config
from relax_slurm.trainer.megatron import vl, vl_moe
from relax_slurm.trainer.megatron.model import freeze


def compose(*overrides: str):
    return compose_config(["experiment=tiny_vl_cpu", "run_dir=/tmp/x", "trainer=megatron",
                           *overrides])


def test_audio_composes_and_is_checked_when_the_model_loads():
    """Audio passes the config under trainer=megatron (Qwen3-Omni's thinker takes it); a model
    that does not is refused at load, when its kind is known (test_video_... below)."""
    cfg = compose("+data.multimodal_keys.audio=audios")
    assert "audio" in cfg.data.multimodal_keys


def test_images_with_tensor_parallelism_compose():
    cfg = compose("trainer.tensor_parallel_size=2", "trainer.nproc_per_node=2",
                  "trainer.freeze_modules=[model.visual]")
    assert cfg.trainer.backend == "megatron" and dict(cfg.data.multimodal_keys)


@pytest.mark.parametrize("overrides, words", [
    (("trainer.pipeline_parallel_size=2", "trainer.nproc_per_node=2"), "tensor parallelism only"),
])
def test_refused_with_the_fix(overrides, words):
    with pytest.raises(Exception) as e:
        compose(*overrides)
    assert words in str(e.value) and "docs/backends.md#multimodal-models" in str(e.value)


def test_video_composes_and_every_vl_kind_takes_it():
    """Video passes the config and each VL kind's megatron forward takes the video tensors
    (Qwen3-VL's frames are spaced by timestamps in the text: no second_per_grid_ts); what is
    neither image nor video is refused at load, naming the fix."""
    cfg = compose("+data.multimodal_keys.video=videos")
    assert "video" in cfg.data.multimodal_keys
    assert set(vl.VIDEO_KEYS) <= set(vl.media_keys(vl.QWEN25))
    for kind in (vl.QWEN25, vl.QWEN3, vl.QWEN3_MOE):
        vl.check_media(kind, cfg.data.multimodal_keys)
        assert {"pixel_values_videos", "video_grid_thw"} <= set(vl.media_keys(kind))
        with pytest.raises(ConfigError, match=r"not \['audio'\].*docs/backends.md#multimodal"):
            vl.check_media(kind, ["image", "audio"])
    # Qwen3-Omni's thinker takes audio too (omni_model.py)
    vl.check_media(vl.OMNI, ["image", "video", "audio"])
    # ... and the videos' seconds under its thinker's name, the one the data processor gives it
    assert {"input_features", "feature_attention_mask", "video_second_per_grid"} <= set(
        vl.media_keys(vl.OMNI))
    assert video_seconds_key("qwen3_omni_moe") in vl.media_keys(vl.OMNI)
    # Qwen2.5-Omni's thinker: the same media and names (omni25_model.py)
    vl.check_media(vl.OMNI25, ["image", "video", "audio"])
    assert video_seconds_key("qwen2_5_omni") in vl.media_keys(vl.OMNI25)
    assert set(vl.media_keys(vl.OMNI25)) == set(vl.media_keys(vl.OMNI))
    assert video_seconds_key("qwen2_5_vl") in vl.media_keys(vl.QWEN25)


def test_qwen25_token_types():
    config = type("C", (), {"image_token_id": 7, "video_token_id": 8})()
    ids = torch.tensor([[1, 7, 7, 2, 8, 8, 8, 0]])
    assert vl.token_types(config, ids).tolist() == [[0, 1, 1, 0, 2, 2, 2, 0]]


def test_unsupported_architectures_name_the_reason():
    # a multimodal model no bridge knows: the message names the ones trainer=megatron trains,
    # the model's type, the fix and the page
    unknown = type("Config", (), {"model_type": "qwen2_vl", "vision_config": object()})()
    with pytest.raises(ConfigError, match=r"Qwen2.5-Omni and Qwen2-Audio.*not "
                                          r"model_type='qwen2_vl'. Fix: trainer=torch "
                                          r"\(docs/backends.md#multimodal"):
        vl.kind(unknown)
    assert vl.kind(Qwen2_5OmniConfig()) == vl.OMNI25  # the project's bridge: omni25_*.py
    assert vl.kind(Qwen3OmniMoeConfig()) == vl.OMNI  # the project's bridge: omni*.py
    assert vl.kind(Qwen3VLMoeConfig()) == vl.QWEN3_MOE  # its experts: vl_moe.py
    assert vl.kind(Qwen2AudioConfig()) == vl.AUDIO  # the project's bridge: audio_*.py


def test_qwen2_audio_takes_audio_alone():
    """Qwen2-Audio's megatron forward takes its mel features and their mask; a run with images
    or video is refused naming what it feeds, and freeze_modules prefixes in transformers 5's
    names or the files' reach its parts."""
    vl.check_media(vl.AUDIO, ["audio"])
    assert vl.media_keys(vl.AUDIO) == ("input_features", "feature_attention_mask")
    with pytest.raises(ConfigError, match=r"feeds qwen2_audio audio, not \['image'\]"):
        vl.check_media(vl.AUDIO, ["audio", "image"])
    for hf, ours in (("model.audio_tower", "audio_tower"),
                     ("audio_tower.layers.0", "audio_tower.layers.0"),
                     ("model.multi_modal_projector", "multi_modal_projector"),
                     ("model.language_model", "language_model"),
                     ("language_model.lm_head", "language_model.output_layer"),
                     ("lm_head", "language_model.output_layer")):
        assert vl.hf_prefix_to_megatron(vl.AUDIO, hf) == ours, hf


@pytest.mark.parametrize("kind, qwen, hf", [
    (vl_moe.GATE_UP, (4, 64, 32), (4, 32, 64)),
    (vl_moe.DOWN, (4, 16, 64), (4, 64, 16)),
])
def test_vl_moe_file_layout_read_from_the_shape(kind, qwen, hf):
    """Qwen's released files and transformers 5's save_pretrained lay the fused experts out
    transposed; the shape says which (hidden 64, expert width 16)."""
    assert not vl_moe.is_transformers_layout(kind, qwen, hidden=64, ffn=16)
    assert vl_moe.is_transformers_layout(kind, hf, hidden=64, ffn=16)
    with pytest.raises(ConfigError, match="expected"):
        vl_moe.is_transformers_layout(kind, (4, 8, 8), hidden=64, ffn=16)


def test_vl_moe_ambiguous_layout_is_refused():
    with pytest.raises(ConfigError, match="reads the same"):  # hidden == 2 x expert width
        vl_moe.is_transformers_layout(vl_moe.GATE_UP, (4, 32, 32), hidden=32, ffn=16)


def test_qwen3_positions_when_a_response_ends_with_vision_start():
    """The bridge's Qwen3-VL get_rope_index read the token after every <|vision_start|>
    (IndexError when a sampled response ended with one); transformers' finds images by their
    image_token_id: text 0,1; a 2x2-merged 4x4 image at (t, h, w) = 2 + (0, h, w); then text
    from 2 + max(h, w) + 1 = 4 on."""
    S, I = 5, 7
    ids = torch.tensor([[1, S, I, I, I, I, 2, 3, S]])
    pos, _ = vl.qwen3_rope_index(2, I, ids, torch.tensor([[1, 4, 4]]))
    assert pos.shape == (3, 1, 9)
    assert pos[:, 0, :2].tolist() == [[0, 1]] * 3
    assert pos[:, 0, 2:6].tolist() == [[2, 2, 2, 2], [2, 2, 3, 3], [2, 3, 2, 3]]
    assert pos[:, 0, 6:].tolist() == [[4, 5, 6]] * 3


def test_freeze_modules_maps_hf_prefixes():
    chunk = torch.nn.Module()
    chunk.visual = torch.nn.Linear(2, 2)
    chunk.language_model = torch.nn.Linear(2, 2)
    prefixes = ["model.visual"]
    freeze([chunk], [vl.hf_prefix_to_megatron(vl.QWEN25, p) for p in prefixes], prefixes)
    assert not chunk.visual.weight.requires_grad and chunk.language_model.weight.requires_grad
    assert vl.hf_prefix_to_megatron(vl.QWEN3, "model.visual.blocks") == "vision_model.blocks"
    with pytest.raises(ConfigError, match="'model.vision' matches no parameter"):
        freeze([chunk], ["model.vision"], ["model.vision"])
