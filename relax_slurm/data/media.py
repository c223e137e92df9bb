"""Media items of a multimodal row: find them, check them, load them, ship them to an engine.

A row names its media in the columns of `data.multimodal_keys` (`{"image": "images", "audio":
"audios"}`): a list per row (or one item). An item is a path (relative to the data file's
folder, or absolute), raw bytes, a `{"bytes", "path"}` dict (how `datasets`' Image and Audio
features store files), and for audio also `{"array", "sampling_rate"}`. The prompt's
`<image>`, `<video>`, `<audio>` placeholders take the items of their kind in order.

Everything here is numpy and PIL: no torch, so the rollout worker can check and load media.
"""

from __future__ import annotations

import base64
import io
import os
import re
import wave
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relax_slurm.data.tracks import track_samples, track_wav
from relax_slurm.errors import DataError

MODALITIES = ("image", "video", "audio")
PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
_PLACEHOLDER_RE = re.compile("|".join(map(re.escape, PLACEHOLDERS.values())))


@dataclass(frozen=True)
class MediaRef:
    """One media item of a row, as the data names it (not decoded yet)."""

    kind: str
    """image, video or audio."""
    path: str | None = None
    """Absolute path of a file; None for inline data."""
    data: bytes | None = None
    """Encoded file bytes (PNG, JPEG, WAV, ...) of inline items."""
    array: tuple[np.ndarray, int] | None = None
    """Decoded audio (samples, sampling rate) of `{"array", "sampling_rate"}` items."""
    where: str = ""
    """File, row, key and item, for error messages."""
    track: bool = False
    """An audio item that is the audio stream of the video file `path` (or bytes `data`):
    data.audio_from_video (tracks.py decodes it)."""
    track_rate_hz: int = 16000
    """The rate a track is resampled to when decoded (data.audio_sampling_rate_hz), so that
    neither engine resamples what it is sent."""

    def to_engine(self) -> str:
        """The item as SGLang's `image_data` / `video_data` / `audio_data` take it: a file name
        (a folder of frames for a video), or base64 (a video's audio track as WAV: engines
        read audio files, not a video's sound)."""
        if self.track:
            wav = track_wav(self.path, self.data, self.track_rate_hz, self.where)
            return base64.b64encode(wav).decode()
        if self.path is not None:
            return self.path
        if self.array is not None:
            return base64.b64encode(wav_bytes(*self.array)).decode()
        return base64.b64encode(self.data).decode()


def from_engine(kind: str, value: Any, where: str) -> MediaRef:
    """A `*_data` entry of a /generate request: an existing file name (or folder of video
    frames), a data URL or base64."""
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: expected a file name or base64 string, got "
                        f"{type(value).__name__}")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    elif os.path.isfile(value) or (kind == "video" and os.path.isdir(value)):
        return MediaRef(kind=kind, path=value, where=where)
    try:
        return MediaRef(kind=kind, data=base64.b64decode(value, validate=True), where=where)
    except ValueError as e:
        raise DataError(f"{where}: neither an existing file nor base64 data") from e


def row_media(cell: Any, kind: str, base_dir: Path, where: str) -> list[MediaRef]:
    """The items of one row's media column (None or [] means none); DataError on a missing
    file or an item of an unknown form."""
    if cell is None:
        return []
    items = list(cell) if isinstance(cell, (list, tuple)) else [cell]
    return [_ref(item, kind, base_dir, f"{where}, item {i}") for i, item in enumerate(items)]


def _ref(item: Any, kind: str, base_dir: Path, where: str) -> MediaRef:
    if isinstance(item, Mapping):
        if item.get("bytes"):
            return MediaRef(kind=kind, data=bytes(item["bytes"]), where=where)
        if kind == "audio" and item.get("array") is not None:
            rate = item.get("sampling_rate")
            if not isinstance(rate, int):
                raise DataError(f"{where}: an audio array needs an integer sampling_rate. Fix: "
                                "store {'array': [...], 'sampling_rate': 16000}")
            return MediaRef(kind=kind, array=(np.asarray(item["array"], np.float32), rate),
                            where=where)
        item = item.get("path")
    if isinstance(item, (bytes, bytearray)):
        return MediaRef(kind=kind, data=bytes(item), where=where)
    if isinstance(item, str) and item:
        path = Path(item) if os.path.isabs(item) else base_dir / item
        if not (path.is_file() or (kind == "video" and path.is_dir())):
            raise DataError(f"{where}: no such file {path}. Fix: paths are relative to the "
                            "data file's folder (or absolute); check the file exists")
        return MediaRef(kind=kind, path=str(path.resolve()), where=where)
    hint = (". Fix: put a clip's frames in a folder and name the folder"
            if kind == "video" and isinstance(item, (list, tuple)) else "")
    raise DataError(f"{where}: a {kind} must be a path, bytes or a {{'bytes', 'path'}} dict, got "
                    f"{type(item).__name__}{hint}")


def count_placeholders(text: str) -> dict[str, int]:
    found = _PLACEHOLDER_RE.findall(text)
    return {kind: found.count(tag) for kind, tag in PLACEHOLDERS.items()}


def check_counts(text: str, media: Mapping[str, Sequence[MediaRef]], where: str) -> None:
    """Each kind's placeholders and items must match one to one."""
    counts = count_placeholders(text)
    for kind in MODALITIES:
        items = len(media.get(kind, ()))
        if counts[kind] != items:
            raise DataError(
                f"{where}: the prompt has {counts[kind]} {PLACEHOLDERS[kind]} placeholder(s) but "
                f"the row has {items} {kind} item(s). Fix: one {PLACEHOLDERS[kind]} per item, in "
                f"order (or map data.multimodal_keys.{kind} to the right column)")


def add_placeholders(messages: list[dict[str, str]], media: Mapping[str, Sequence[MediaRef]]
                     ) -> list[dict[str, str]]:
    """One placeholder per item at the start of the first user message, for each kind whose
    placeholders the messages lack altogether (`data.add_missing_placeholders`).

    >>> add_placeholders([{"role": "user", "content": "What colour?"}],
    ...                  {"image": [MediaRef(kind="image", path="/a.png")]})[0]["content"]
    '<image>What colour?'
    """
    counts = count_placeholders("".join(m["content"] for m in messages))
    prefix = "".join(PLACEHOLDERS[k] * len(media.get(k, ())) for k in MODALITIES
                     if counts[k] == 0)
    if not prefix:
        return messages
    out = [dict(m) for m in messages]
    first = next((m for m in out if m["role"] == "user"), out[0])
    first["content"] = prefix + first["content"]
    return out


def add_video_tracks(messages: list[dict[str, str]], media: Mapping[str, Sequence[MediaRef]],
                     sounding: Sequence[bool], rate_hz: int = 16000
                     ) -> tuple[list[dict[str, str]], dict]:
    """data.audio_from_video: an <audio> right after each <video> whose clip has sound
    (`sounding`, one flag per video item) and, at its place among the row's own audio items
    (placeholder order), an audio item for that clip's track, decoded at `rate_hz`. Counts
    already checked.

    >>> video = MediaRef(kind="video", path="/a.mp4")
    >>> msgs, items = add_video_tracks([{"role": "user", "content": "<video>Heard?<audio>"}],
    ...     {"video": [video], "audio": [MediaRef(kind="audio", path="/b.wav")]}, [True])
    >>> msgs[0]["content"], [(a.path, a.track) for a in items["audio"]]
    ('<video><audio>Heard?<audio>', [('/a.mp4', True), ('/b.wav', False)])
    """
    if not any(sounding):
        return messages, dict(media)
    videos = iter(zip(media.get("video", ()), sounding))
    own = iter(media.get("audio", ()))
    audio: list[MediaRef] = []

    def place(match: re.Match) -> str:
        tag = match.group(0)
        if tag == PLACEHOLDERS["audio"]:
            audio.append(next(own))
        elif tag == PLACEHOLDERS["video"]:
            video, sound = next(videos)
            if sound:
                audio.append(MediaRef(kind="audio", path=video.path, data=video.data,
                                      where=f"{video.where} (its audio track)", track=True,
                                      track_rate_hz=rate_hz))
                return tag + PLACEHOLDERS["audio"]
        return tag

    out = [{**m, "content": _PLACEHOLDER_RE.sub(place, m["content"])} for m in messages]
    return out, {**media, "audio": audio}


def replace_placeholders(text: str, tokens: Mapping[str, str]) -> str:
    """`<image>` etc. -> the model's own markers (`<|vision_start|><|image_pad|><|vision_end|>`),
    one pad token per item; the processor expands each pad to the item's token count."""
    return _PLACEHOLDER_RE.sub(lambda m: tokens[_KIND_OF[m.group(0)]], text)


_KIND_OF = {tag: kind for kind, tag in PLACEHOLDERS.items()}


# ---- decoding ----------------------------------------------------------------------------------

def _read(ref: MediaRef) -> bytes:
    if ref.data is not None:
        return ref.data
    try:
        return Path(ref.path).read_bytes()
    except OSError as e:
        raise DataError(f"{ref.where}: cannot read {ref.path} ({e}). Fix: check the file") from e


def load_image(ref: MediaRef) -> Any:
    """An RGB `PIL.Image`; DataError naming the item if it is not a readable image."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(_read(ref)))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        what = ref.path or f"{len(ref.data or b'')} bytes"
        raise DataError(f"{ref.where}: {what} is not a readable image ({e}). Fix: replace the "
                        "file or drop the row") from e
    return img.convert("RGB")


def check_image(ref: MediaRef) -> None:
    """Open the header only (cheap): a file that is not an image fails at load time."""
    from PIL import Image, UnidentifiedImageError

    try:
        Image.open(io.BytesIO(_read(ref)) if ref.data is not None else ref.path).size
    except (UnidentifiedImageError, OSError, ValueError) as e:
        what = ref.path or f"{len(ref.data or b'')} bytes"
        raise DataError(f"{ref.where}: {what} is not a readable image ({e}). Fix: replace the "
                        "file or drop the row") from e


def load_audio(ref: MediaRef, rate_hz: int) -> np.ndarray:
    """Mono float32 samples at `rate_hz` from a WAV file (PCM 8/16/32-bit), an array item or a
    video's audio track.

    Other rates are resampled by linear interpolation (enough for speech features; convert
    offline with a proper resampler for anything demanding)."""
    if ref.track:
        samples = track_samples(ref.path, ref.data, ref.track_rate_hz, ref.where)
        rate = ref.track_rate_hz
    elif ref.array is not None:
        samples, rate = ref.array
    else:
        try:
            with wave.open(io.BytesIO(_read(ref))) as w:
                width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
                raw = w.readframes(w.getnframes())
        except (wave.Error, EOFError) as e:
            what = ref.path or "inline bytes"
            raise DataError(f"{ref.where}: {what} is not a PCM WAV file ({e}). Fix: convert it "
                            "to WAV, or store {'array', 'sampling_rate'}") from e
        dtype = {1: np.uint8, 2: "<i2", 4: "<i4"}.get(width)
        if dtype is None:
            raise DataError(f"{ref.where}: {width * 8}-bit WAV is not supported; use 16-bit PCM")
        pcm = np.frombuffer(raw, dtype=dtype).astype(np.float32)
        pcm = (pcm - 128.0) / 128.0 if width == 1 else pcm / float(2 ** (8 * width - 1))
        samples = pcm.reshape(-1, channels).mean(axis=1)
    samples = np.asarray(samples, np.float32).reshape(-1)
    if rate != rate_hz and len(samples):
        n = int(round(len(samples) * rate_hz / rate))
        samples = np.interp(np.arange(n) * (rate / rate_hz), np.arange(len(samples)),
                            samples).astype(np.float32)
    return samples


def wav_bytes(samples: np.ndarray, rate_hz: int) -> bytes:
    """16-bit PCM mono WAV of float samples in [-1, 1]."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate_hz))
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def sample_frame_indices(num_frames: int, native_fps: float, fps: float, min_frames: int,
                         max_frames: int) -> list[int]:
    """Indices of the frames a video keeps: `fps` frames per second of its duration, clamped to
    [min_frames, max_frames] (and to what exists), rounded to an even count (Qwen-VL groups
    frames in pairs), evenly spaced.

    >>> sample_frame_indices(100, native_fps=25.0, fps=2.0, min_frames=4, max_frames=768)
    [0, 14, 28, 42, 57, 71, 85, 99]
    """
    if num_frames <= 0:
        return []
    want = num_frames / native_fps * fps
    n = int(min(max(want, min_frames), max_frames, num_frames))
    n = max(2, n - n % 2) if num_frames >= 2 else 1
    return [int(round(i)) for i in np.linspace(0, num_frames - 1, n)]
