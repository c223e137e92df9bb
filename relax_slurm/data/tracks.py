"""A video file's sound as an audio item (data.audio_from_video): its first audio stream decoded
by PyAV, mixed to mono and resampled by FFmpeg's resampler to 16-bit PCM at the processor's
rate. The worker's samples (`track_samples`) and what an engine is sent (`track_wav`, a WAV of
the same PCM) are equal bit for bit, and no engine resamples.

numpy and PyAV only (no torch), like video.py: the rollout worker decodes here.
"""

from __future__ import annotations

import functools
import io
import wave

import numpy as np

from relax_slurm.errors import DataError


def track_samples(path: str | None, data: bytes | None, rate_hz: int, where: str
                  ) -> np.ndarray:
    """Mono float32 samples at `rate_hz` of the video file `path` (or its bytes `data`)."""
    return _pcm_of(path, data, rate_hz, where).astype(np.float32) / 32768.0  # as a WAV reads


def track_wav(path: str | None, data: bytes | None, rate_hz: int, where: str) -> bytes:
    """The same sound as a 16-bit PCM mono WAV file at `rate_hz`."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate_hz)
        w.writeframes(_pcm_of(path, data, rate_hz, where).astype("<i2").tobytes())
    return buf.getvalue()


def _pcm_of(path: str | None, data: bytes | None, rate_hz: int, where: str) -> np.ndarray:
    try:
        return _pcm(path, data, rate_hz)
    except DataError as e:  # the row it was read for (the cache serves a clip to every row)
        raise DataError(f"{where}: {e}") from e.__cause__


@functools.lru_cache(maxsize=8)  # a group's N requests send one clip's sound N times
def _pcm(path: str | None, data: bytes | None, rate_hz: int) -> np.ndarray:
    import av

    what = path or f"{len(data or b'')} bytes of video"
    try:
        with av.open(path if data is None else io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise DataError(f"{what} has no audio stream. Fix: set "
                                "data.audio_from_video=false, or add the sound to the file")
            resampler = av.AudioResampler(format="s16", layout="mono", rate=rate_hz)
            stream = container.streams.audio[0]
            parts = [out.to_ndarray().reshape(-1)
                     for frame in container.decode(stream) for out in resampler.resample(frame)]
            parts += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    except (av.FFmpegError, OSError, ValueError) as e:
        raise DataError(f"the audio of {what} is not readable ({e}). Fix: re-encode the "
                        "file, or set data.audio_from_video=false") from e
    pcm = np.concatenate(parts) if parts else np.zeros(0, np.int16)
    pcm.setflags(write=False)  # shared by the cache's callers
    return pcm
