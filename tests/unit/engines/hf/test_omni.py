"""The hf engine serves a Qwen3-Omni directory as SGLang serves it (issue #38): its thinker
generates, the talker and code2wav are not built (never trained, never sent: modeling.
NOT_SERVED), and a weight update names the checkpoint files' `thinker.*` tensors. The tiny
omni3 (relax_slurm/tiny/multimodal.py) with its saved preprocessor: an image row and an audio
row go through the real loading code (AutoImageProcessor / AutoFeatureExtractor of one
preprocessor_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers_tiny import make_tiny_omni
from fastapi.testclient import TestClient

from relax_slurm.engines.hf.core import HFEngine
from relax_slurm.engines.hf.server import build_app

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> Path:
    """The tiny Qwen3-Omni and one image and one audio of the tiny tasks."""
    return make_tiny_omni(tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="module")
def omni25(tmp_path_factory) -> Path:
    """The tiny Qwen2.5-Omni (thinker, talker, token2wav, spk_dict.pt) and the same media."""
    return make_tiny_omni(tmp_path_factory.mktemp("omni25"), "omni25")


# Qwen2.5-Omni: its own names of the media tokens (<|IMAGE|>, <|vision_bos|>...), its
# audio encoder's token count (Qwen2-Audio's), its token2wav never built
OMNIS = {"omni3": ("qwen3_omni_moe", "Qwen3OmniMoeThinkerForConditionalGeneration"),
         "omni25": ("qwen2_5_omni", "Qwen2_5OmniThinkerForConditionalGeneration")}


@pytest.fixture(params=list(OMNIS))
def any_omni(request) -> tuple[Path, str, str]:
    return (request.getfixturevalue("omni" if request.param == "omni3" else "omni25"),
            *OMNIS[request.param])


def test_the_tiny_omni_saves_a_processor_the_loading_code_reads(any_omni) -> None:
    from transformers import AutoTokenizer

    from relax_slurm.data.media import MediaRef
    from relax_slurm.data.processor import MediaProcessor, audio_token_count

    omni, model_type, _ = any_omni
    model = omni / "model"
    mp = MediaProcessor(model, AutoTokenizer.from_pretrained(model).get_vocab())
    assert mp.model_type == model_type
    assert type(mp.image_processor()).__name__.startswith("Qwen2VLImageProcessor")
    assert type(mp.feature_extractor()).__name__ == "WhisperFeatureExtractor"
    image = next((omni / "colors").glob("*.png"))
    audio = next((omni / "tones").glob("*.wav"))
    pads = mp.pad_ids
    out = mp.process([pads["image"], 5, pads["audio"]],
                     {"image": [MediaRef(kind="image", path=str(image))],
                      "audio": [MediaRef(kind="audio", path=str(audio))]})
    assert out.tensors["input_features"].shape[1] == 16  # the thinker's mel bins
    frames = int(out.tensors["feature_attention_mask"].sum())
    assert out.input_ids.count(pads["audio"]) == audio_token_count(model_type, frames)
    assert out.input_ids.count(pads["image"]) == int(out.tensors["image_grid_thw"].prod()) // 4


def test_the_engine_generates_with_the_thinker_and_takes_the_files_names(any_omni) -> None:
    from safetensors.torch import load_file

    from relax_slurm.modeling import NOT_SERVED, media_token_ids
    from relax_slurm.weightsync.receiver import tensor_sha256

    omni, _, thinker_class = any_omni
    model = omni / "model"
    engine = HFEngine(str(model), None, "float32", "cpu", 8, 1.0, "0", 30.0)
    assert type(engine.lm).__name__ == thinker_class
    for part in ("talker", "code2wav", "token2wav"):
        assert not hasattr(engine.model, part), part
    engine.start()
    try:
        with TestClient(build_app(engine, 30.0)) as http:
            image = str(next((omni / "colors").glob("*.png")))
            audio = str(next((omni / "tones").glob("*.wav")))
            cfg = json.loads((model / "config.json").read_text())["thinker_config"]
            start, end = cfg["vision_start_token_id"], cfg["vision_end_token_id"]
            pad = {k: cfg.get(f"{k}_token_id", cfg.get(f"{k}_token_index"))  # 2.5: *_index
                   for k in ("image", "audio")}
            ids = [[start, pad["image"], end, 5], [pad["audio"], 5]]
            r = http.post("/generate", json={
                "input_ids": ids, "image_data": [[image], None], "audio_data": [None, [audio]],
                "sampling_params": {"max_new_tokens": 4, "temperature": 1.0,
                                    "sampling_seed": 3, "ignore_eos": True},
                "return_logprob": True})
            assert r.status_code == 200, r.text
            items = r.json()
            banned = set(media_token_ids(engine.model.config))
            for item in items:
                assert len(item["output_ids"]) == 4
                assert not banned & set(item["output_ids"])
            # the image's and the audio's pads expanded (more prompt tokens than sent)
            assert all(i["meta_info"]["prompt_tokens"] > len(x) for i, x in zip(items, ids))

            # the weights go by the files' names (the thinker's): every one lands, and the
            # checksums the trainer verifies against are under those names too
            on_file = load_file(str(model / "model.safetensors"))
            thinker = {n: t for n, t in on_file.items() if not n.startswith(NOT_SERVED)}
            assert any(n.startswith("thinker.audio_tower.") for n in thinker)
            new = {n: t + 0.01 for n, t in thinker.items()}
            assert http.post("/begin_weight_update", json={}).status_code == 200
            engine.update_weights_from_tensor(list(new.items()), "1", flush_cache=False)
            assert http.post("/end_weight_update", json={}).status_code == 200
            sums = engine.checksums()
            assert all(sums[n] == tensor_sha256(t) for n, t in new.items())
            again = http.post("/generate", json={
                "input_ids": ids[1], "audio_data": [audio],
                "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}})
            assert again.status_code == 200 and again.json()["meta_info"]["weight_version"] \
                == "1"
    finally:
        engine.shutdown()


def test_a_videos_sound_is_an_audio_item_after_it_that_the_engine_hears_as_the_worker(
        omni: Path, tmp_path: Path) -> None:
    """data.audio_from_video: a clip with sound (a 440 Hz tone at 44.1 kHz in a .mkv) is a
    video item and, right after it, an audio item of its track, resampled to the processor's
    rate by FFmpeg; a clip without sound stays a picture. The engine is sent the track as the
    worker reads it, bit for bit (a WAV at the processor's rate), so both count the same tokens
    and compute the same features; the thinker generates from the row."""
    import numpy as np
    from transformers import AutoTokenizer

    from relax_slurm.config.data import DataConfig
    from relax_slurm.data import PromptDataset
    from relax_slurm.data.media import from_engine
    from relax_slurm.data.processor import MediaProcessor
    from relax_slurm.data.tracks import track_samples
    from relax_slurm.data.video import write_video
    from relax_slurm.errors import ConfigError

    model = omni / "model"
    frames = [np.full((32, 32, 3), 40 * t + 10, np.uint8) for t in range(4)]
    rate = 44100
    tone = 0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)  # 1 s
    write_video(tmp_path / "sound.mkv", frames, 4, audio=(tone, rate))
    write_video(tmp_path / "silent.mp4", frames, 4)
    rows = [{"prompt": "<video>heard?", "label": "a", "videos": ["sound.mkv"]},
            {"prompt": "<video> and <audio>", "label": "b", "videos": ["silent.mp4"],
             "audios": [str(next((omni / "tones").glob("*.wav")))]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(train_files=[str(tmp_path / "rows.jsonl")], shuffle=False,
                     apply_chat_template=False, video_min_frames=2,
                     multimodal_keys={"video": "videos", "audio": "audios"},
                     audio_from_video=True)
    tok = AutoTokenizer.from_pretrained(model)
    ds = PromptDataset(cfg, tok)
    sound, silent = ds[0], ds[1]
    assert [a.track for a in sound.media["audio"]] == [True]
    track = sound.media["audio"][0]
    at = track.track_rate_hz
    heard = track_samples(track.path, track.data, at, track.where)
    want = 0.5 * np.sin(2 * np.pi * 440 * np.arange(len(heard)) / at)
    assert at == cfg.audio_sampling_rate_hz and len(heard) == at  # 1 s, at 16 kHz
    assert np.corrcoef(heard, want)[0, 1] > 0.999  # the tone (a wrong rate: another pitch)
    assert [a.track for a in silent.media["audio"]] == [False]  # its own audio only
    audio_markers = "<|audio_bos|><|AUDIO|><|audio_eos|>"
    assert sound.text.startswith("<|vision_start|><|video_pad|><|vision_end|>" + audio_markers)
    assert silent.text.count(audio_markers) == 1

    mp = MediaProcessor(model, tok.get_vocab())
    sent = {k: [from_engine(k, x.to_engine(), "sent") for x in refs]
            for k, refs in sound.media.items()}
    worker = mp.process(list(sound.input_ids), sound.media)
    engine_side = mp.process(list(sound.input_ids), sent)  # what the engine decodes
    assert worker.input_ids == engine_side.input_ids
    for key, value in worker.tensors.items():
        assert np.array_equal(np.asarray(value), np.asarray(engine_side.tensors[key])), key
    assert worker.input_ids.count(mp.pad_ids["audio"]) > 1  # the second of sound, heard

    engine = HFEngine(str(model), None, "float32", "cpu", 8, 1.0, "0", 30.0)
    engine.start()
    try:
        with TestClient(build_app(engine, 30.0)) as http:
            r = http.post("/generate", json={
                "input_ids": list(sound.input_ids),
                "video_data": [x.to_engine() for x in sound.media["video"]],
                "audio_data": [x.to_engine() for x in sound.media["audio"]],
                "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}})
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["prompt_tokens"] == len(worker.input_ids)
    finally:
        engine.shutdown()

    with pytest.raises(ConfigError, match="data.multimodal_keys has no video column"):
        DataConfig(train_files=["x"], audio_from_video=True)
