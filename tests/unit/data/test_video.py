"""Video items: decoding (PyAV) and frame folders, sampling, processing into video patches, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer

from relax_slurm.config.data import DataConfig
from relax_slurm.data import PromptDataset
from relax_slurm.data.media import MediaRef
from relax_slurm.data.processor import MediaLimits, MediaProcessor
from relax_slurm.data.video import VideoLimits, load_video, write_video
from relax_slurm.errors import ConfigError, DataError

VIDEO_MARKERS = "<|vision_start|><|video_pad|><|vision_end|>"


def gray_frames(n: int, size: int = 56) -> list[np.ndarray]:
    """Frame t is uniformly grey level 20 * t + 10 (distinct, and clear of codec noise)."""
    return [np.full((size, size, 3), 20 * t + 10, np.uint8) for t in range(n)]


def frame_folder(folder: Path, frames: list[np.ndarray]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for t, arr in enumerate(frames):
        Image.fromarray(arr).save(folder / f"{t:03d}.png")
    return folder


def test_decode_file_and_bytes_sampled_at_fps(tmp_path: Path) -> None:
    write_video(tmp_path / "v.mp4", gray_frames(12), fps=4)  # 3 s
    ref = MediaRef(kind="video", path=str(tmp_path / "v.mp4"), where="r")
    frames = load_video(ref, VideoLimits(fps=2.0, min_frames=2, max_frames=100))
    assert len(frames.images) == 6 and frames.sampled_fps == pytest.approx(2.0)
    # evenly spaced over the clip: indices 0, 2, 4, 7, 9, 11 of the 12 frames
    levels = [int(np.asarray(im)[28, 28, 0]) for im in frames.images]
    assert levels == pytest.approx([10, 50, 90, 150, 190, 230], abs=4)  # H.264 is lossy
    inline = MediaRef(kind="video", data=(tmp_path / "v.mp4").read_bytes(), where="r")
    capped = load_video(inline, VideoLimits(fps=2.0, min_frames=2, max_frames=4))
    assert len(capped.images) == 4 and capped.sampled_fps == pytest.approx(4 / 3)


def test_frame_folder_taken_at_video_fps(tmp_path: Path) -> None:
    folder = frame_folder(tmp_path / "clip", gray_frames(5))
    (folder / "notes.txt").write_text("ignored")
    frames = load_video(MediaRef(kind="video", path=str(folder), where="r"),
                        VideoLimits(fps=2.0, min_frames=2, max_frames=8))
    assert [int(np.asarray(im)[0, 0, 0]) for im in frames.images] == [10, 30, 70, 90]
    assert frames.sampled_fps == pytest.approx(4 / 2.5)  # 4 kept of 5 frames shot at 2 fps


def test_video_patches_match_the_image_path(tiny_mm_assets: Path, tmp_path: Path) -> None:
    """A clip of two copies of one frame is, patch for patch, that frame as an image (the image
    path repeats a frame over the temporal patch); longer clips keep frame order in pairs."""
    tok = AutoTokenizer.from_pretrained(tiny_mm_assets / "vl_model")
    limits = MediaLimits(video=VideoLimits(fps=2.0, min_frames=2, max_frames=8))
    mp = MediaProcessor(tiny_mm_assets / "vl_model", tok.get_vocab(), limits)
    ids = tok(f"a{VIDEO_MARKERS}b")["input_ids"]
    pad = tok.convert_tokens_to_ids("<|video_pad|>")

    rng = np.random.default_rng(0)
    still = rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)
    two = frame_folder(tmp_path / "two", [still, still])
    out = mp.process(ids, {"video": [MediaRef(kind="video", path=str(two))]})
    Image.fromarray(still).save(tmp_path / "still.png")
    image = mp.process(tok("<|vision_start|><|image_pad|><|vision_end|>")["input_ids"],
                       {"image": [MediaRef(kind="image", path=str(tmp_path / "still.png"))]})
    np.testing.assert_array_equal(out.tensors["pixel_values_videos"],
                                  image.tensors["pixel_values"])
    assert out.tensors["video_grid_thw"].tolist() == [[1, 4, 4]]
    assert out.tensors["second_per_grid_ts"].tolist() == [pytest.approx(1.0)]  # 2 frames / 2 fps
    assert out.input_ids.count(pad) == 4 and len(out.input_ids) == len(ids) + 3

    frames = [rng.integers(0, 255, (56, 56, 3), dtype=np.uint8) for _ in range(5)]
    five = frame_folder(tmp_path / "five", frames)
    out = mp.process(ids, {"video": [MediaRef(kind="video", path=str(five))]})
    kept = [0, 1, 3, 4]  # 4 of 5 frames (an even count)
    assert out.tensors["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert out.input_ids.count(pad) == 2 * 16 // 4
    pv = out.tensors["pixel_values_videos"].reshape(2, 16, 3, 2, 14 * 14)  # [t, S, C, T, P*P]
    for t in range(2):
        for k in range(2):
            Image.fromarray(frames[kept[2 * t + k]]).save(tmp_path / "f.png")
            single = mp.process(tok("<|vision_start|><|image_pad|><|vision_end|>")["input_ids"],
                                {"image": [MediaRef(kind="image", path=str(tmp_path / "f.png"))]})
            want = single.tensors["pixel_values"].reshape(16, 3, 2, 14 * 14)[:, :, 0]
            np.testing.assert_array_equal(pv[t, :, :, k], want)


def test_pixel_limits_apply_to_frames(tiny_mm_assets: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_mm_assets / "vl_model")
    write_video(tmp_path / "wide.mp4", [np.zeros((100, 200, 3), np.uint8)] * 4, fps=4)
    ref = MediaRef(kind="video", path=str(tmp_path / "wide.mp4"))
    ids = tok(VIDEO_MARKERS)["input_ids"]

    def grid(video_max_pixels: int | None = None, **pixels) -> list[int]:
        video = VideoLimits(fps=4.0, min_frames=2, max_frames=4, max_pixels=video_max_pixels)
        limits = MediaLimits(video=video, **pixels)
        mp = MediaProcessor(tiny_mm_assets / "vl_model", tok.get_vocab(), limits)
        return mp.process(ids, {"video": [ref]}).tensors["video_grid_thw"][0].tolist()

    assert grid() == [2, 2, 4]  # the model's own max_pixels (56*56) bounds every frame
    assert grid(image_max_pixels=28 * 28) == [2, 2, 2]
    assert grid(video_max_pixels=28 * 28) == [2, 2, 2]  # videos' own cap wins ...
    assert grid(video_max_pixels=56 * 56, image_max_pixels=28 * 28) == [2, 2, 4]  # ... both ways


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def video_dataset(root: Path, rows: list[dict], **kw) -> PromptDataset:
    cfg = DataConfig(train_files=[str(write_rows(root / "rows.jsonl", rows))],
                     multimodal_keys={"video": "videos"}, **kw)
    return PromptDataset(cfg, AutoTokenizer.from_pretrained(root / "vl_model"))


def test_dataset_rows_and_errors(tiny_mm_assets: Path) -> None:
    ds = video_dataset(tiny_mm_assets, [{"prompt": "<video>=", "label": "2",
                                         "videos": ["change/red_to_blue_0.mp4"]}])
    assert ds[0].text == f"{VIDEO_MARKERS}="
    assert ds[0].media["video"][0].path.endswith("red_to_blue_0.mp4")

    with pytest.raises(DataError, match=r"row 0, key 'videos', item 0: no such file .*nope.mp4"):
        video_dataset(tiny_mm_assets, [{"prompt": "<video>=", "label": "0",
                                        "videos": ["nope.mp4"]}])
    (tiny_mm_assets / "bad.mp4").write_bytes(b"not a video" * 50)
    with pytest.raises(DataError, match=r"row 0, key 'videos', item 0: .*bad.mp4 is not a "
                                        r"readable video"):
        video_dataset(tiny_mm_assets, [{"prompt": "<video>=", "label": "0",
                                        "videos": ["bad.mp4"]}])
    (tiny_mm_assets / "empty_clip").mkdir(exist_ok=True)
    with pytest.raises(DataError, match="holds no frame images"):
        video_dataset(tiny_mm_assets, [{"prompt": "<video>=", "label": "0",
                                        "videos": ["empty_clip"]}])
    with pytest.raises(DataError, match="got list. Fix: put a clip's frames in a folder"):
        video_dataset(tiny_mm_assets, [{"prompt": "<video>=", "label": "0",
                                        "videos": [["a.png", "b.png"]]}])
    with pytest.raises(DataError, match=r"1 <video> placeholder\(s\) but the row has 2"):
        video_dataset(tiny_mm_assets, [{"prompt": "<video>=", "label": "0",
                                        "videos": ["change/red_to_blue_2.mp4"] * 2}])
    with pytest.raises(ConfigError, match="data.video_min_frames=5 must be >= 1 and <= "):
        DataConfig(train_files=["x"], video_min_frames=5, video_max_frames=4)


def test_too_few_frames_and_mixed_sizes(tmp_path: Path) -> None:
    write_video(tmp_path / "short.mp4", gray_frames(3), fps=4)
    short = MediaRef(kind="video", path=str(tmp_path / "short.mp4"), where="rows.jsonl, row 2")
    with pytest.raises(DataError, match=r"row 2: .*short.mp4 has 3 frame\(s\), fewer than "
                                        r"data.video_min_frames=4. Fix: lower"):
        load_video(short, VideoLimits(fps=2.0, min_frames=4, max_frames=8))
    folder = frame_folder(tmp_path / "mixed", gray_frames(2) + gray_frames(2, size=28))
    with pytest.raises(DataError, match="differ in size"):
        load_video(MediaRef(kind="video", path=str(folder), where="r"),
                   VideoLimits(fps=2.0, min_frames=2, max_frames=8))


def qwen3_vl_processor(tok: Any) -> Any:
    """transformers' own `Qwen3VLProcessor`, for its text side: `replace_video_token` (the
    timestamped layout) and `create_mm_token_type_ids`. Its constructor insists on the video
    processor, which needs torchvision (no CPU build here), so it is built without `__init__`;
    the video processor likewise, keeping its class defaults (merge 2, temporal patch 2)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    proc.video_processor = Qwen3VLVideoProcessor.__new__(Qwen3VLVideoProcessor)
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    proc.image_token_id = tok.convert_tokens_to_ids(proc.image_token)
    proc.video_token_id = tok.convert_tokens_to_ids(proc.video_token)
    return proc


def test_qwen3_vl_video_tokens_are_its_processors(tiny_mm_assets: Path, tmp_path: Path) -> None:
    """Qwen3-VL: a video's pad becomes, per frame pair, "<t seconds>" + start + pads + end; the
    ids and token types equal what `Qwen3VLProcessor` makes of the same grid and frames, the
    hf engine's already-expanded ids pass unchanged, and the model's forward takes them."""
    import torch
    from transformers import AutoModelForMultimodalLM
    from transformers.video_utils import VideoMetadata

    from relax_slurm.modeling import mm_token_types

    model = tiny_mm_assets / "vl3_model"
    tok = AutoTokenizer.from_pretrained(model)
    write_video(tmp_path / "v.mp4", gray_frames(10), fps=4)  # 2.5 s
    limits = MediaLimits(video=VideoLimits(fps=2.0, min_frames=2, max_frames=100))
    ref = MediaRef(kind="video", path=str(tmp_path / "v.mp4"), where="r")
    frames = load_video(ref, limits.video)
    assert frames.indices == [0, 3, 6, 9] and frames.native_fps == 4.0
    mp = MediaProcessor(model, tok.get_vocab(), limits)
    prompt = "1" + VIDEO_MARKERS + "="
    out = mp.process(tok(prompt)["input_ids"], {"video": [ref]})
    assert "second_per_grid_ts" not in out.tensors  # Qwen3-VL's forward spaces frames by text

    real = qwen3_vl_processor(tok)
    meta = VideoMetadata(total_num_frames=10, fps=4.0, frames_indices=frames.indices)
    grid = torch.from_numpy(out.tensors["video_grid_thw"])
    expansion = real.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    assert expansion.startswith("<0.4 seconds><|vision_start|><|video_pad|>")  # (0+3)/2/4 s
    assert "<1.9 seconds>" in expansion  # (6+9)/2/4 s
    expected = tok(prompt.replace("<|video_pad|>", expansion))["input_ids"]
    assert out.input_ids == expected
    assert mp.process(out.input_ids, {"video": [ref]}).input_ids == expected  # engine side

    vlm = AutoModelForMultimodalLM.from_pretrained(model)
    ids = torch.tensor([out.input_ids])
    tensors = {k: torch.from_numpy(v) for k, v in out.tensors.items()}
    types = mm_token_types(vlm, ids, tensors)["mm_token_type_ids"]
    assert types.tolist() == real.create_mm_token_type_ids([expected])
    with torch.no_grad():  # one M-RoPE grid per frame pair, each between its own markers
        assert vlm(input_ids=ids, mm_token_type_ids=types, **tensors).logits.shape[1] == len(ids[0])
    first_pad = out.input_ids.index(real.video_token_id)
    with pytest.raises(DataError, match="neither one pad nor its expansion"):  # a pad short
        mp.process(out.input_ids[:first_pad] + out.input_ids[first_pad + 1:], {"video": [ref]})


@pytest.mark.parametrize("model_type, cls", [
    ("qwen2_5_vl", "transformers.Qwen2_5_VLForConditionalGeneration"),
    # what trainer=torch and the hf engine run of Qwen3-Omni: its thinker (modeling.py)
    ("qwen3_omni_moe", "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe."
                       "Qwen3OmniMoeThinkerForConditionalGeneration"),
    ("qwen2_5_omni", "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni."
                     "Qwen2_5OmniThinkerForConditionalGeneration")])
def test_the_videos_seconds_go_by_the_name_the_models_forward_takes(model_type, cls):
    """Under another name the tensor falls into the forward's **kwargs and the model spaces
    no frame in time (Qwen3-Omni's position code then indexes None)."""
    import importlib
    import inspect

    from relax_slurm.data.processor import video_seconds_key

    module, name = cls.rsplit(".", 1)
    forward = getattr(importlib.import_module(module), name).forward
    assert video_seconds_key(model_type) in inspect.signature(forward).parameters


def test_audio_from_video_needs_a_model_that_hears(tiny_mm_assets: Path) -> None:
    """The tiny Qwen2.5-VL's tokenizer has no audio tokens: its clips' sound is refused at
    start, naming the key and the fix (docs/multimodal.md#video-with-sound)."""
    with pytest.raises(ConfigError, match=r"data.audio_from_video=true, but the tokenizer has "
                                          r"no audio tokens.*Fix: set data.audio_from_video=false"):
        video_dataset(tiny_mm_assets, [{"prompt": "<video>=", "label": "2",
                                        "videos": ["change/red_to_blue_0.mp4"]}],
                      audio_from_video=True)
