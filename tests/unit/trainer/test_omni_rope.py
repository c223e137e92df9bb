"""The Omni thinkers under trainer=megatron, their pure pieces: the M-RoPE positions
(trainer/megatron/omni_rope.py) of hand-worked rows in the layout Qwen3-Omni's processor writes
(marker, pads, marker), and the freeze prefixes."""

from __future__ import annotations

import types

import torch

from relax_slurm.trainer.megatron.omni_rope import omni_rope_index

TXT, S, E, IMG, VID, AS, AUD, AE, PAD = 1, 10, 11, 12, 13, 20, 21, 22, 0


def thinker(position_id_per_seconds: int = 25) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        image_token_id=IMG, video_token_id=VID, audio_token_id=AUD, vision_start_token_id=S,
        audio_start_token_id=AS, position_id_per_seconds=position_id_per_seconds,
        vision_config=types.SimpleNamespace(spatial_merge_size=2),
        audio_config=types.SimpleNamespace(n_window=50))


def test_image_then_audio_then_text_and_padding():
    """An image of 4x4 patches (2x2 tokens after the merge) takes a (t, h, w) grid starting
    after its marker; the text after it resumes past the grid's largest position; an audio of
    37 mel frames (5 tokens) counts by one after its start marker; padding gets 0."""
    row = [TXT, TXT, S] + [IMG] * 4 + [E, AS] + [AUD] * 5 + [AE, TXT]
    ids = torch.tensor([row + [PAD, PAD]])
    mask = torch.tensor([[1] * len(row) + [0, 0]])
    pos = omni_rope_index(thinker(), ids, mask, image_grid_thw=torch.tensor([[1, 4, 4]]),
                          audio_feature_lengths=torch.tensor([37]))
    t, h, w = (pos[k, 0].tolist() for k in range(3))
    text = [0, 1, 2]
    assert t == text + [3, 3, 3, 3] + [5, 6] + [7, 8, 9, 10, 11] + [12, 13] + [0, 0]
    assert h == text + [3, 3, 4, 4] + [5, 6] + [7, 8, 9, 10, 11] + [12, 13] + [0, 0]
    assert w == text + [3, 4, 3, 4] + [5, 6] + [7, 8, 9, 10, 11] + [12, 13] + [0, 0]


def test_video_frames_are_spaced_by_seconds():
    """A video of two temporal patches of 2x2 patches (one token each): its t steps by
    second_per_grid x position_id_per_seconds (0.5 s x 25 = 12.5, float as transformers')."""
    ids = torch.tensor([[S, VID, VID, E, TXT]])
    pos = omni_rope_index(thinker(), ids, video_grid_thw=torch.tensor([[2, 2, 2]]),
                          second_per_grid=torch.tensor([0.5]))
    assert pos[0, 0].tolist() == [0, 1, 13.5, 14.5, 15.5]
    assert pos[1, 0].tolist() == pos[2, 0].tolist() == [0, 1, 1, 14.5, 15.5]


def test_without_images_or_videos_every_position_is_text():
    """transformers' quirk, kept (the engines compute the same): a batch without images and
    videos gets 1-D positions, audio included."""
    ids = torch.tensor([[TXT, AS, AUD, AUD, AE, TXT]])
    pos = omni_rope_index(thinker(), ids, audio_feature_lengths=torch.tensor([5]))
    assert all(pos[k, 0].tolist() == list(range(6)) for k in range(3))


def test_freeze_prefixes_of_the_omni_thinker():
    """trainer.freeze_modules names of the thinker's parts (transformers' and the files', as
    experiment=qwen3_omni_30b_a3b_avqa writes them) -> the megatron model's."""
    from relax_slurm.trainer.megatron import vl

    assert vl.hf_prefix_to_megatron(vl.OMNI, "thinker.audio_tower") == "audio_model"
    assert vl.hf_prefix_to_megatron(vl.OMNI, "thinker.visual.blocks") == "vision_model.blocks"
    assert vl.hf_prefix_to_megatron(vl.OMNI, "thinker.model.audio_tower.conv2d1") == (
        "audio_model.conv2d1")
    assert vl.hf_prefix_to_megatron(vl.OMNI, "thinker.model.language_model") == "language_model"
    assert vl.hf_prefix_to_megatron(vl.OMNI, "thinker.lm_head") == "language_model.output_layer"
    # Qwen2.5-Omni's towers keep their HF names in the megatron model (omni25_model.py)
    assert vl.hf_prefix_to_megatron(vl.OMNI25, "thinker.audio_tower") == "audio_tower"
    assert vl.hf_prefix_to_megatron(vl.OMNI25, "thinker.model.visual.blocks") == "visual.blocks"
    assert vl.hf_prefix_to_megatron(vl.OMNI25, "thinker.lm_head") == (
        "language_model.output_layer")


def test_sampled_start_markers_are_text():
    """A response may hold a start marker (only the pads are never sampled): it counts by one,
    as the engine counts every generated token, instead of being read as a second audio (whose
    length transformers took from the next row's audio: positions ran backwards, RuntimeError
    in the first end-to-end run) or an image marker read past the row's end."""
    audio = [TXT, AS] + [AUD] * 5 + [AE, TXT]
    image = [S] + [IMG] * 4 + [E, TXT]
    rows = [audio + [AS, TXT, S], image + [AS, AS, TXT, S, PAD]]
    ids = torch.tensor(rows)
    mask = (ids != PAD).long()
    pos = omni_rope_index(thinker(), ids, mask, image_grid_thw=torch.tensor([[1, 4, 4]]),
                          audio_feature_lengths=torch.tensor([37]))
    assert pos[0, 0].tolist() == list(range(12))  # the audio counts by one: all text-like
    assert pos[:, 0].tolist() == [list(range(12))] * 3
    after_image = [3, 4, 5, 6, 7, 8]  # E, TXT, then the sampled AS, AS, TXT, S by one each
    assert pos[0, 1].tolist() == [0, 1, 1, 1, 1] + after_image + [0]
    assert pos[1, 1].tolist() == [0, 1, 1, 2, 2] + after_image + [0]


def test_qwen25_omni_positions_follow_the_same_rules_with_its_own_lengths():
    """Qwen2.5-Omni's thinker (omni25_rope_index, transformers' own function): an image's
    grid after its marker, an audio of 37 mel frames as 9 tokens (stride-2 conv, pooling by 2)
    counting by one, padding at 1 (its reference's fill); a video's t steps by
    second_per_grid x 25, truncated to an integer (0.5 s -> 12); and a sampled start marker
    (`<|audio_bos|>`, `<|vision_bos|>` in a response) counts by one as text, where
    transformers' function looked for a second audio's pads (ValueError in the first
    end-to-end run, a shape mismatch in the reference model's forward)."""
    from relax_slurm.trainer.megatron.omni_rope import omni25_rope_index

    cfg = thinker()
    cfg.seconds_per_chunk = 2
    image = [TXT, TXT, S] + [IMG] * 4 + [E, AS] + [AUD] * 9 + [AE, TXT]
    sampled = [TXT, AS] + [AUD] * 9 + [AE, TXT, AS, TXT, S]
    rows = [image + [AS, PAD], sampled + [PAD] * (len(image) + 2 - len(sampled))]
    ids = torch.tensor(rows)
    mask = (ids != PAD).long()
    pos = omni25_rope_index(cfg, ids, mask, image_grid_thw=torch.tensor([[1, 4, 4]]),
                            audio_feature_lengths=torch.tensor([37, 37]))
    t, h, w = (pos[k, 0].tolist() for k in range(3))
    text, audio = [0, 1, 2], list(range(7, 16))
    assert t == text + [3, 3, 3, 3] + [5, 6] + audio + [16, 17, 18, 1]
    assert h == text + [3, 3, 4, 4] + [5, 6] + audio + [16, 17, 18, 1]
    assert w == text + [3, 4, 3, 4] + [5, 6] + audio + [16, 17, 18, 1]
    n = len(sampled)
    assert pos[:, 1].tolist() == [list(range(n)) + [1] * (len(rows[1]) - n)] * 3

    clip = torch.tensor([[S, VID, VID, E, TXT]])
    pos = omni25_rope_index(cfg, clip, video_grid_thw=torch.tensor([[2, 2, 2]]),
                            second_per_grid=torch.tensor([0.5]))
    assert pos[0, 0].tolist() == [0, 1, 13, 14, 15]
    assert pos[1, 0].tolist() == pos[2, 0].tolist() == [0, 1, 1, 14, 15]
