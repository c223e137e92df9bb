"""Video items: decode a clip (PyAV) or read a folder of frames, and keep the sampled frames.

A video item is a video file (mp4, webm, mkv, avi, ...: whatever the ffmpeg bundled with PyAV
decodes), its encoded bytes, or a folder of frame images (png, jpg, ... sorted by file name,
taken as shot at `data.video_fps`). Frames are sampled with `sample_frame_indices` (`fps` frames
per second of the clip, clamped to [min_frames, max_frames], an even count); the image
processor then resizes them under the image pixel limits and the processor groups them in
pairs (`relax_slurm.data.processor`).

numpy, PIL and PyAV only (no torch): the rollout worker decodes here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from relax_slurm.config.check import default_of
from relax_slurm.config.data import DataConfig
from relax_slurm.data.media import MediaRef, sample_frame_indices
from relax_slurm.errors import DataError

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(kw_only=True)
class VideoLimits:
    """Frame sampling knobs (data.video_* keys)."""

    fps: float = default_of(DataConfig, "video_fps")
    min_frames: int = default_of(DataConfig, "video_min_frames")
    max_frames: int = default_of(DataConfig, "video_max_frames")
    max_pixels: int | None = default_of(DataConfig, "video_max_pixels")
    """Largest frame in pixels; None: the image limit."""


@dataclass(kw_only=True)
class Frames:
    """The sampled frames of one video."""

    images: list[Any]
    """RGB `PIL.Image`s, all of one size, in time order."""
    sampled_fps: float
    """Frames kept per second of the clip (what temporal positions are spaced by)."""
    indices: list[int]
    """Each kept frame's index in the clip (Qwen3-VL's timestamps are index / native_fps)."""
    native_fps: float
    """The clip's own frame rate (a frame folder's: data.video_fps)."""


def load_video(ref: MediaRef, limits: VideoLimits) -> Frames:
    """The item's sampled frames; DataError naming the item if it cannot be decoded, has fewer
    frames than `limits.min_frames`, or its frames differ in size."""
    if ref.path is not None and Path(ref.path).is_dir():
        files = frame_files(ref)
        native_fps = limits.fps
        total = len(files)
        keep = _sample(ref, total, native_fps, limits)
        images = [_open_frame(ref, files[i]) for i in keep]
    else:
        images, total, native_fps, keep = _decode(ref, limits)
    sizes = {im.size for im in images}
    if len(sizes) > 1:
        raise DataError(f"{ref.where}: the frames of {ref.path} differ in size {sorted(sizes)}. "
                        "Fix: resize every frame of a video to one size")
    return Frames(images=images, sampled_fps=len(images) / (total / native_fps),
                  indices=list(keep), native_fps=native_fps)


def check_video(ref: MediaRef) -> bool:
    """Cheap check when the dataset loads: a folder holds frames, a file has a video stream.
    Returns whether the item has an audio stream too (a frame folder never has;
    data.audio_from_video hears it), from the same opening of the file."""
    if ref.path is not None and Path(ref.path).is_dir():
        frame_files(ref)
        return False
    with _open(ref) as container:
        if not container.streams.video:
            raise DataError(f"{ref.where}: {_what(ref)} has no video stream. Fix: replace the "
                            "file or drop the row")
        return bool(container.streams.audio)


def frame_files(ref: MediaRef) -> list[Path]:
    files = sorted(p for p in Path(ref.path).iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
    if not files:
        raise DataError(f"{ref.where}: the folder {ref.path} holds no frame images "
                        f"({', '.join(FRAME_SUFFIXES)}). Fix: put the frames there, or name a "
                        "video file")
    return files


def _sample(ref: MediaRef, total: int, native_fps: float, limits: VideoLimits) -> list[int]:
    if total < limits.min_frames or total == 0:
        raise DataError(f"{ref.where}: {_what(ref)} has {total} frame(s), fewer than "
                        f"data.video_min_frames={limits.min_frames}. Fix: lower "
                        "data.video_min_frames, or drop the row")
    return sample_frame_indices(total, native_fps, limits.fps, limits.min_frames,
                                limits.max_frames)


def _open_frame(ref: MediaRef, path: Path) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{ref.where}: frame {path} is not a readable image ({e}). Fix: replace "
                        "the file") from e


def _what(ref: MediaRef) -> str:
    return ref.path or f"{len(ref.data or b'')} bytes of video"


def _open(ref: MediaRef) -> Any:
    import av

    try:
        return av.open(ref.path if ref.data is None else io.BytesIO(ref.data), mode="r")
    except (av.FFmpegError, OSError, ValueError) as e:
        raise DataError(f"{ref.where}: {_what(ref)} is not a readable video ({e}). Fix: "
                        "replace the file or drop the row") from e


def _decode(ref: MediaRef, limits: VideoLimits) -> tuple[list[Any], int, float, list[int]]:
    """(sampled frames, frames in the clip, native fps, the kept frames' indices): frames are
    counted by decoding when the container does not say (webm), then the kept ones converted
    on a second pass."""
    import av

    try:
        with _open(ref) as container:
            if not container.streams.video:
                raise DataError(f"{ref.where}: {_what(ref)} has no video stream. Fix: replace "
                                "the file or drop the row")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or Fraction(limits.fps)
            total = stream.frames or sum(1 for _ in container.decode(stream))
        keep = set(_sample(ref, total, float(rate), limits))
        images = []
        with _open(ref) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in keep:
                    images.append(frame.to_image().convert("RGB"))
    except av.FFmpegError as e:
        raise DataError(f"{ref.where}: {_what(ref)} is not a readable video ({e}). Fix: "
                        "replace the file or drop the row") from e
    if len(images) < len(keep):  # the header promised more frames than the stream holds
        raise DataError(f"{ref.where}: {_what(ref)} decoded {len(images)} frame(s) of the "
                        f"{total} its header declares (truncated?). Fix: re-encode the file")
    return images, total, float(rate), sorted(keep)


def write_video(path: str | Path, frames: list[np.ndarray], fps: int,
                audio: tuple[np.ndarray, int] | None = None) -> None:
    """Encode RGB frames ([H, W, 3] uint8, even sizes) as H.264 (MPEG-4 where PyAV lacks it)
    in the container `path` names (tools and tests). `audio`: (mono float samples in [-1, 1],
    rate in Hz) as a 16-bit PCM stream, which a .mkv or .mov holds bit for bit (so a test knows
    the samples the file carries; an .mp4 does not hold PCM)."""
    import av

    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264" if "libx264" in av.codecs_available
                                     else "mpeg4", rate=fps)
        video.height, video.width = frames[0].shape[:2]
        video.pix_fmt = "yuv420p"
        for arr in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        packets = list(video.encode())
        if audio is not None:
            samples, rate_hz = audio
            stream = container.add_stream("pcm_s16le", rate=rate_hz, layout="mono")
            pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16).reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            frame.sample_rate = rate_hz
            packets += [*stream.encode(frame), *stream.encode()]
        for packet in packets:
            container.mux(packet)
