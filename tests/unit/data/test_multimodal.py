"""Multimodal rows: placeholders, media files and bytes, processing limits, bad inputs."""

from __future__ import annotations

import base64
import doctest
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from relax_slurm.config.data import DataConfig
from relax_slurm.data import PromptDataset, media, processor
from relax_slurm.data.media import MediaRef, from_engine, load_audio, wav_bytes
from relax_slurm.data.processor import MediaLimits, MediaProcessor, expand_pads
from relax_slurm.errors import ConfigError, DataError


def test_doctests() -> None:
    for module in (media, processor):
        assert doctest.testmod(module).failed == 0


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def vl_dataset(tiny_mm_assets: Path, rows: list[dict], parquet: bool = False,
               **kw) -> PromptDataset:
    if parquet:  # inline bytes need a binary column
        import datasets

        path = tiny_mm_assets / "rows.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = write_rows(tiny_mm_assets / "rows.jsonl", rows)
    cfg = DataConfig(train_files=[str(path)], multimodal_keys={"image": "images"}, **kw)
    return PromptDataset(cfg, AutoTokenizer.from_pretrained(tiny_mm_assets / "vl_model"))


def test_placeholders_replaced_in_order_and_expanded(tiny_mm_assets: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_mm_assets / "vl_model")
    red = (tiny_mm_assets / "colors" / "red_0.png").read_bytes()
    ds = vl_dataset(tiny_mm_assets, [{"prompt": "1<image>2<image>=", "label": "0",
                                      "images": [{"path": "colors/blue_1.png", "bytes": None},
                                                 {"path": None, "bytes": red}]}], parquet=True)
    p = ds[0]
    assert p.text == "1<|vision_start|><|image_pad|><|vision_end|>2" \
                     "<|vision_start|><|image_pad|><|vision_end|>="
    assert [r.path is not None for r in p.media["image"]] == [True, False]
    assert p.media["image"][0].path.endswith("blue_1.png")  # relative to the data file
    mp = MediaProcessor(tiny_mm_assets / "vl_model", tok.get_vocab())
    out = mp.process(p.input_ids, p.media)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert out.input_ids.count(pad) == 8  # two 56x56 images: 16 patches / (2x2 merge) each
    assert out.tensors["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert out.tensors["pixel_values"].shape == (32, 3 * 2 * 14 * 14)
    # expanded ids pass through unchanged (what the engine gets from the worker)
    assert mp.process(out.input_ids, p.media).input_ids == out.input_ids


def test_image_pixel_limits(tiny_mm_assets: Path) -> None:
    from PIL import Image

    Image.new("RGB", (200, 100), (9, 9, 9)).save(tiny_mm_assets / "wide.png")
    tok = AutoTokenizer.from_pretrained(tiny_mm_assets / "vl_model")
    ref = MediaRef(kind="image", path=str(tiny_mm_assets / "wide.png"))
    ids = tok("<|vision_start|><|image_pad|><|vision_end|>")["input_ids"]

    def grid(**limits) -> list[int]:
        mp = MediaProcessor(tiny_mm_assets / "vl_model", tok.get_vocab(), MediaLimits(**limits))
        return mp.process(ids, {"image": [ref]}).tensors["image_grid_thw"][0].tolist()

    assert grid() == [1, 2, 4]  # the model's own max_pixels (56*56) bounds it
    assert grid(image_max_pixels=28 * 28) == [1, 2, 2]  # the smallest a 2x2 merge allows
    assert np.prod(grid(image_min_pixels=56 * 56, image_max_pixels=112 * 112)) >= 16


def test_audio_matches_the_models_own_processor(tiny_mm_assets: Path) -> None:
    from transformers import AutoProcessor

    path = tiny_mm_assets / "audio_model"
    full = AutoProcessor.from_pretrained(path)
    tok = full.tokenizer
    wav = tiny_mm_assets / "tones" / "440_1.wav"
    text = "<|audio_bos|><|AUDIO|><|audio_eos|>1="
    ref_out = full(text=[text], audio=[load_audio(MediaRef(kind="audio", path=str(wav)), 16000)],
                   return_tensors="np")
    out = MediaProcessor(path, tok.get_vocab()).process(
        tok(text)["input_ids"], {"audio": [MediaRef(kind="audio", path=str(wav))]})
    assert out.input_ids == ref_out["input_ids"][0].tolist()
    np.testing.assert_array_equal(out.tensors["input_features"], ref_out["input_features"])
    assert out.tensors["feature_attention_mask"].sum() == 100  # 1 s at 100 frames/s


def test_audio_resampled_and_array_items() -> None:
    t = np.arange(8000) / 8000
    samples = np.sin(2 * np.pi * 100 * t).astype(np.float32) * 0.5
    ref = MediaRef(kind="audio", data=wav_bytes(samples, 8000))
    out = load_audio(ref, 16000)
    assert len(out) == 16000 and abs(out.max() - 0.5) < 0.01
    arr = MediaRef(kind="audio", array=(samples, 8000))
    assert len(load_audio(arr, 16000)) == 16000
    # the engine transport: base64 WAV, decoded back to the same samples
    back = from_engine("audio", arr.to_engine(), "req")
    np.testing.assert_allclose(load_audio(back, 8000), samples, atol=1e-4)


def test_count_mismatch_names_file_row_and_key(tiny_mm_assets: Path) -> None:
    with pytest.raises(DataError, match=r"rows.jsonl, row 1, key 'prompt'.*2 <image>.*1 image"):
        vl_dataset(tiny_mm_assets, [
            {"prompt": "<image>=", "label": "0", "images": ["colors/red_0.png"]},
            {"prompt": "<image><image>=", "label": "0", "images": ["colors/red_0.png"]}])


def test_missing_file_and_unreadable_image(tiny_mm_assets: Path) -> None:
    with pytest.raises(DataError, match=r"row 0, key 'images', item 0: no such file .*nope.png"):
        vl_dataset(tiny_mm_assets, [{"prompt": "<image>=", "label": "0",
                                     "images": ["nope.png"]}])
    (tiny_mm_assets / "bad.png").write_text("not an image")
    with pytest.raises(DataError, match=r"row 0, key 'images', item 0: .*bad.png is not a "
                                        r"readable image"):
        vl_dataset(tiny_mm_assets, [{"prompt": "<image>=", "label": "0", "images": ["bad.png"]}])
    with pytest.raises(DataError, match="not a readable image"):
        vl_dataset(tiny_mm_assets, [{"prompt": "<image>=", "label": "0",
                                     "images": [b"garbage"]}], parquet=True)


def test_model_without_the_tokens_and_unknown_kind(tiny_mm_assets: Path) -> None:
    path = write_rows(tiny_mm_assets / "a.jsonl", [{"prompt": "<audio>=", "label": "0",
                                                   "audios": ["tones/440_1.wav"]}])
    cfg = DataConfig(train_files=[str(path)], multimodal_keys={"audio": "audios"})
    with pytest.raises(ConfigError, match="no tokens for them"):
        PromptDataset(cfg, AutoTokenizer.from_pretrained(tiny_mm_assets / "vl_model"))
    with pytest.raises(ConfigError, match="unknown kinds"):
        DataConfig(train_files=["x"], multimodal_keys={"picture": "images"})


def test_expand_pads_errors() -> None:
    with pytest.raises(DataError, match="1 pad runs in the ids but 2 media items"):
        expand_pads([9, 5], pad_id=9, counts=[2, 2], where="x")
    with pytest.raises(DataError, match="item 0 has 3 pad tokens, expected 1 or 4"):
        expand_pads([9, 9, 9], pad_id=9, counts=[4], where="x")


def test_from_engine_forms(tmp_path: Path) -> None:
    f = tmp_path / "x.png"
    f.write_bytes(b"abc")
    assert from_engine("image", str(f), "r").path == str(f)
    b64 = base64.b64encode(b"abc").decode()
    assert from_engine("image", b64, "r").data == b"abc"
    assert from_engine("image", f"data:image/png;base64,{b64}", "r").data == b"abc"
    with pytest.raises(DataError, match="neither an existing file nor base64"):
        from_engine("image", "/no/such/file.png", "r")


def test_add_missing_placeholders(tiny_mm_assets: Path) -> None:
    rows = [{"prompt": [{"role": "system", "content": "Think."},
                        {"role": "user", "content": "Which colour?"}],
             "label": "0", "images": "colors/red_0.png"}]  # one item, not a list
    with pytest.raises(DataError, match="0 <image> placeholder"):
        vl_dataset(tiny_mm_assets, rows)
    p = vl_dataset(tiny_mm_assets, rows, add_missing_placeholders=True)[0]
    assert p.text == "Think.<|vision_start|><|image_pad|><|vision_end|>Which colour?"


def test_audio_token_counts_are_the_encoders_own() -> None:
    """The audio token rules docs/multimodal.md lists, against transformers' own length
    functions (the encoders the engines run): Qwen2-Audio and Qwen2.5-Omni (stride-2 conv, then
    pooling by 2), Qwen3-Omni (13 tokens per 100-frame chunk, the remainder by three stride-2
    convs); frame counts across chunk boundaries and 30 s of mel frames."""
    import torch
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths as qwen3_omni_lengths,
    )

    frames = torch.arange(3, 3001)
    for model_type, encoder in (("qwen2_audio", Qwen2AudioEncoder),
                                ("qwen2_5_omni", Qwen2_5OmniAudioEncoder)):
        _, want = encoder._get_feat_extract_output_lengths(None, frames)
        got = [processor.audio_token_count(model_type, int(n)) for n in frames]
        assert got == want.tolist(), model_type
    want = qwen3_omni_lengths(frames)
    got = [processor.audio_token_count("qwen3_omni_moe", int(n)) for n in frames]
    assert got == want.tolist()
    # and the vocabulary's audio markers: Qwen3-Omni's where it has them
    qwen3 = {t: i for i, t in enumerate(["<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"])}
    assert processor.model_markers(qwen3) == {
        "audio": ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")}
