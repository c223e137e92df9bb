"""`data`: the prompt dataset, its columns and the media limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from relax_slurm.config.check import check

@dataclass(kw_only=True)
class DataConfig:
    train_files: list[str] = MISSING
    """jsonl / parquet files or a saved HF dataset folder."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    label_key: str = "label"
    """Column holding the reference answer given to the reward."""
    metadata_key: Optional[str] = None
    """Optional column passed through to the reward as metadata."""
    system_prompt: Optional[str] = None
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (false: raw text)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after the template) are filtered out, with a count logged."""
    shuffle: bool = True
    seed: int = 0
    num_epochs: int = 1000
    """Passes over the data; the run also stops at trainer.total_steps."""
    multimodal_keys: dict[str, str] = field(default_factory=dict)
    """Media columns by kind, e.g. {image: images, video: videos, audio: audios}; the prompt's
    <image>, <video> and <audio> placeholders take the row's items in order
    (docs/multimodal.md)."""
    add_missing_placeholders: bool = False
    """A row whose prompt has no <image>/<video>/<audio> placeholder for its items gets one per
    item at the start of its first user message (datasets that keep the image beside the
    text)."""
    image_min_pixels: Optional[int] = None
    """Images smaller than this many pixels are upscaled; null: the image processor's own."""
    image_max_pixels: Optional[int] = None
    """Images larger than this many pixels are downscaled (bounds image tokens); null: own."""
    video_fps: float = 2.0
    """Frames kept per second of a video (a folder of frames is taken as shot at this rate)."""
    video_min_frames: int = 4
    """Fewest frames a video keeps; a video with fewer frames is a data error."""
    video_max_frames: int = 768
    """Most frames a video keeps (bounds video tokens with the pixels per frame)."""
    video_max_pixels: Optional[int] = None
    """Largest video frame in pixels (Qwen-VL's own video default: 602112 = 768 x 28 x 28);
    null: data.image_max_pixels. Video tokens <= frames / 2 x this / (patch x merge)^2."""
    audio_sampling_rate_hz: int = 16000
    """Audio is resampled to this rate before the feature extractor (Whisper-style: 16 kHz)."""
    audio_from_video: bool = False
    """A video file's audio stream becomes an audio item of its own, right after the video
    (an <audio> after its <video>): Qwen-Omni models hear the clip. Not Qwen's interleaved
    `use_audio_in_video` layout, which SGLang does not compute
    (docs/multimodal.md#video-with-sound). Clips without sound and frame folders stay
    pictures only."""
    media_num_workers: int = 4
    """Threads of the rollout worker that decode and process media (PIL and numpy release the
    GIL for most of it), so rollout is not bound by one core's decoding."""

    @property
    def media_kinds(self) -> list[str]:
        """The kinds of media a row may carry: data.multimodal_keys', and audio with
        data.audio_from_video."""
        extra = ["audio"] if self.audio_from_video and "audio" not in self.multimodal_keys else []
        return [*self.multimodal_keys, *extra]

    def __post_init__(self) -> None:
        check(self.train_files == MISSING or len(self.train_files) > 0,
               "data.train_files is empty: set data.train_files=[path/to/train.jsonl]")
        bad = set(self.multimodal_keys) - {"image", "video", "audio"}
        check(not bad, f"data.multimodal_keys has unknown kinds {sorted(bad)}: use image, "
               "video or audio, e.g. data.multimodal_keys={image: images}")
        check(self.image_min_pixels is None or self.image_max_pixels is None
               or 0 < self.image_min_pixels <= self.image_max_pixels,
               f"data.image_min_pixels={self.image_min_pixels} must be > 0 and <= "
               f"data.image_max_pixels={self.image_max_pixels}")
        check(self.video_fps > 0, f"data.video_fps={self.video_fps}: must be > 0")
        check(1 <= self.video_min_frames <= self.video_max_frames,
               f"data.video_min_frames={self.video_min_frames} must be >= 1 and <= "
               f"data.video_max_frames={self.video_max_frames}")
        check(self.video_max_pixels is None or self.image_min_pixels is None
               or 0 < self.image_min_pixels <= self.video_max_pixels,
               f"data.video_max_pixels={self.video_max_pixels} must be > 0 and >= "
               f"data.image_min_pixels={self.image_min_pixels}")
        check(not self.audio_from_video or "video" in self.multimodal_keys,
               "data.audio_from_video=true takes the audio of the rows' videos, but "
               "data.multimodal_keys has no video column: add one (e.g. "
               "data.multimodal_keys={video: videos}) or set data.audio_from_video=false")
        check(self.audio_sampling_rate_hz > 0,
               f"data.audio_sampling_rate_hz={self.audio_sampling_rate_hz}: must be > 0")
        check(self.media_num_workers >= 1,
               f"data.media_num_workers={self.media_num_workers}: must be >= 1")
