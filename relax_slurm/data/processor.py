"""Multimodal processing with the model's own processors: media -> tensors + expanded token ids.

The model directory's image processor (`AutoImageProcessor`: pixel limits, patch and merge
sizes) and audio feature extractor (`AutoProcessor(...).feature_extractor` or
`AutoFeatureExtractor`: mel bins, chunk length, sampling rate) turn a prompt's media into the
tensors the model's forward takes (`pixel_values`, `image_grid_thw`, `input_features`,
`feature_attention_mask`), and each item's pad token in the ids is expanded to the item's
token count, exactly as the model's full processor (`Qwen2_5_VLProcessor`, ...) does in text.
The expansion is ours because the full processor of the VL families loads torchvision's video
processor, which CPU-only machines lack; the image processor falls back to its PIL flavour.

The same `MediaProcessor` runs in the rollout worker (tensors for the trainer, carried in the
sample) and in the hf engine (tensors for generation), so both see the same tokens.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relax_slurm.config.check import default_of
from relax_slurm.config.data import DataConfig
from relax_slurm.data.media import MediaRef, load_audio, load_image
from relax_slurm.data.video import VideoLimits, load_video
from relax_slurm.errors import DataError

# The model's own markers per kind, (start, pad, end): the first set whose tokens are all in the
# vocabulary is used (Qwen2/2.5/3-VL and Omni vision; Qwen2-Audio/2.5-Omni, then Qwen3-Omni audio)
MODEL_TOKENS: dict[str, list[tuple[str, str, str]]] = {
    "image": [("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
              ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>")],
    "video": [("<|vision_start|>", "<|video_pad|>", "<|vision_end|>"),
              ("<|vision_bos|>", "<|VIDEO|>", "<|vision_eos|>")],
    "audio": [("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"),
              ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")],
}


# Qwen3-VL (and its MoE) writes a "<t seconds>" text and its own markers before each frame
# pair of a video (Qwen3VLProcessor.replace_video_token) instead of one run of pads
TIMESTAMPED_VIDEO_MODEL_TYPES = ("qwen3_vl",)
VIDEO_SECONDS_KEYS = {"qwen3_omni": "video_second_per_grid",
                      "qwen2_5_omni": "video_second_per_grid"}


def video_seconds_key(model_type: str) -> str:
    """The name the model's forward (and its processor) gives a video's seconds per temporal
    patch, which M-RoPE spaces its frames by: Qwen2/2.5-VL's `second_per_grid_ts`, the Omni
    thinkers' (Qwen3's, Qwen2.5's) `video_second_per_grid` (under the other name it was
    dropped into **kwargs, and transformers' position code indexed None)."""
    for prefix, key in VIDEO_SECONDS_KEYS.items():
        if model_type.startswith(prefix):
            return key
    return "second_per_grid_ts"


def model_markers(vocab: Mapping[str, int]) -> dict[str, tuple[str, str, str]]:
    """kind -> (start, pad, end) tokens this vocabulary has (kinds it lacks are left out)."""
    out = {}
    for kind, options in MODEL_TOKENS.items():
        for tokens in options:
            if all(t in vocab for t in tokens):
                out[kind] = tokens
                break
    return out


def audio_token_count(model_type: str, frames: int) -> int:
    """Tokens the audio encoder makes of `frames` mel frames (valid ones, before padding)."""
    if model_type.startswith("qwen3_omni"):
        leave = frames % 100  # Qwen3-Omni encodes 100-frame chunks of 13 tokens
        feat = (leave - 1) // 2 + 1
        return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13
    # Qwen2-Audio and Qwen2.5-Omni: conv stride 2, then pooling by 2
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def expand_pads(ids: Sequence[int], pad_id: int, counts: Sequence[int], where: str) -> list[int]:
    """Each run of `pad_id` (one per item, in order) becomes `counts[i]` pads. A run already of
    that length is kept, so expanded ids pass through unchanged.

    >>> expand_pads([5, 9, 6, 9, 9, 7], pad_id=9, counts=[3, 2], where="x")
    [5, 9, 9, 9, 6, 9, 9, 7]
    """
    out: list[int] = []
    runs = 0
    i = 0
    while i < len(ids):
        if ids[i] != pad_id:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == pad_id:
            j += 1
        if runs >= len(counts):
            raise DataError(f"{where}: more pad runs ({runs + 1}+) than media items "
                            f"({len(counts)}). Fix: one placeholder per item")
        if j - i not in (1, counts[runs]):
            raise DataError(f"{where}: item {runs} has {j - i} pad tokens, expected 1 or "
                            f"{counts[runs]} (its processed size)")
        out += [pad_id] * counts[runs]
        runs += 1
        i = j
    if runs != len(counts):
        raise DataError(f"{where}: {runs} pad runs in the ids but {len(counts)} media items. "
                        "Fix: one placeholder per item, in order")
    return out


def expand_items(ids: Sequence[int], pad_id: int, expansions: Sequence[Sequence[int]],
                 where: str) -> list[int]:
    """Each single `pad_id` (one per item, in order) becomes `expansions[i]`, a token list that
    holds the item's pads among other tokens (Qwen3-VL's video: timestamps and markers around
    each frame pair's pads). Ids where item i's expansion already stands (its tokens before the
    first pad included) pass unchanged.

    >>> exp = [3, 5, 9, 9, 6, 3, 5, 9, 9]  # (3, 5) before each run of two pads 9, 6 after one
    >>> expand_items([5, 9, 6], pad_id=9, expansions=[exp], where="x")
    [5, 3, 5, 9, 9, 6, 3, 5, 9, 9, 6]
    >>> expand_items([5, 3, 5, 9, 9, 6, 3, 5, 9, 9, 6], pad_id=9, expansions=[exp], where="x")
    [5, 3, 5, 9, 9, 6, 3, 5, 9, 9, 6]
    """
    out: list[int] = []
    i = item = 0
    while i < len(ids):
        if ids[i] != pad_id:
            out.append(ids[i])
            i += 1
            continue
        if item >= len(expansions):
            raise DataError(f"{where}: more pad runs ({item + 1}+) than media items "
                            f"({len(expansions)}). Fix: one placeholder per item")
        exp = list(expansions[item])
        lead = exp.index(pad_id)  # the expansion's tokens before its first pad
        rest = len(exp) - lead
        if lead <= len(out) and out[len(out) - lead:] == exp[:lead] \
                and list(ids[i:i + rest]) == exp[lead:]:
            out += exp[lead:]  # already expanded
            i += rest
        elif i + 1 == len(ids) or ids[i + 1] != pad_id:
            out += exp
            i += 1
        else:
            raise DataError(f"{where}: item {item}'s pads are neither one pad nor its expansion "
                            f"({len(exp)} tokens). Fix: send the ids unexpanded")
        item += 1
    if item != len(expansions):
        raise DataError(f"{where}: {item} pad runs in the ids but {len(expansions)} media "
                        "items. Fix: one placeholder per item, in order")
    return out


def frame_pair_seconds(indices: Sequence[int], native_fps: float, temporal: int) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's (index /
    native fps), the last frame repeated to fill the final patch, as
    `Qwen3VLProcessor._calculate_timestamps` (transformers 5.x, processing_qwen3_vl.py) does.

    >>> frame_pair_seconds([0, 1, 2, 3, 4], native_fps=4.0, temporal=2)
    [0.125, 0.625, 1.0]
    """
    idx = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    return [(idx[i] + idx[i + temporal - 1]) / 2 / native_fps for i in range(0, len(idx), temporal)]


def timestamped_video_tokens(seconds: Sequence[float], frame_tokens: int,
                             text_ids: Any, start: int, pad: int, end: int) -> list[int]:
    """Qwen3-VL's expansion of one video's pad: per temporal patch the text `<{t:.1f} seconds>`
    (its ids from `text_ids(str)`), then start, `frame_tokens` pads, end
    (`Qwen3VLProcessor.replace_video_token`). The chat template's own start/end stay around it.

    >>> timestamped_video_tokens([0.25, 1.0], 2, lambda t: [len(t)], start=7, pad=9, end=8)
    [13, 7, 9, 9, 8, 13, 7, 9, 9, 8]
    """
    out: list[int] = []
    for t in seconds:
        out += list(text_ids(f"<{t:.1f} seconds>")) + [start] + [pad] * frame_tokens + [end]
    return out


@dataclass(kw_only=True)
class Processed:
    """A prompt ready for a multimodal forward."""

    input_ids: list[int]
    """Token ids with every media pad expanded, [P]."""
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    """Forward kwargs: pixel_values [N, D], image_grid_thw [n, 3], input_features
    [n, mel, frames], feature_attention_mask [n, frames]."""


@dataclass(kw_only=True)
class MediaLimits:
    """Processing knobs (data.* keys)."""

    image_min_pixels: int | None = default_of(DataConfig, "image_min_pixels")
    image_max_pixels: int | None = default_of(DataConfig, "image_max_pixels")
    audio_sampling_rate_hz: int = default_of(DataConfig, "audio_sampling_rate_hz")
    video: VideoLimits = field(default_factory=VideoLimits)
    """Frame sampling of videos (their frames are resized under the image pixel limits)."""

    @classmethod
    def of(cls, d: Any) -> "MediaLimits":
        """From the data.* keys: a DataConfig, or the hf engine's flags of the same names."""
        return cls(image_min_pixels=d.image_min_pixels, image_max_pixels=d.image_max_pixels,
                   audio_sampling_rate_hz=d.audio_sampling_rate_hz,
                   video=VideoLimits(fps=d.video_fps, min_frames=d.video_min_frames,
                                     max_frames=d.video_max_frames,
                                     max_pixels=d.video_max_pixels))


class MediaProcessor:
    """The model's processors, loaded on first use; thread-safe (`process` may run in a pool)."""

    def __init__(self, model_path: str | Path, vocab: Mapping[str, int],
                 limits: MediaLimits | None = None) -> None:
        self.model_path = str(model_path)
        self.limits = limits or MediaLimits()
        self.markers = model_markers(vocab)
        self.pad_ids = {k: vocab[t[1]] for k, t in self.markers.items()}
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.model_type = str(config.get("model_type", ""))
        self._lock = threading.Lock()
        self._image: Any = None
        self._audio: Any = None
        self._tokenizer: Any = None
        self._marker_ids = {k: tuple(vocab[x] for x in t) for k, t in self.markers.items()}

    def timestamps_videos(self) -> bool:
        """Whether a video's pad becomes timestamped frame pairs (Qwen3-VL), not one run."""
        return self.model_type.startswith(TIMESTAMPED_VIDEO_MODEL_TYPES)

    def marker_text(self) -> dict[str, str]:
        """kind -> the text a placeholder becomes (start + one pad + end)."""
        return {k: "".join(t) for k, t in self.markers.items()}

    def image_processor(self) -> Any:
        with self._lock:
            if self._image is None:
                from transformers import AutoImageProcessor

                self._image = AutoImageProcessor.from_pretrained(self.model_path)
            return self._image

    def text_ids(self, text: str) -> list[int]:
        """Token ids of plain text (the model directory's tokenizer, no special tokens)."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            tok = self._tokenizer
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def feature_extractor(self) -> Any:
        with self._lock:
            if self._audio is None:
                self._audio = _load_feature_extractor(self.model_path)
            return self._audio

    def process(self, input_ids: Sequence[int], media: Mapping[str, Sequence[MediaRef]],
                where: str = "prompt") -> Processed:
        """Decode and process every item; expand each kind's pads to its token counts."""
        ids = list(input_ids)
        tensors: dict[str, np.ndarray] = {}
        for kind, refs in media.items():
            if not refs:
                continue
            if kind not in self.markers:
                raise DataError(f"{where}: {len(refs)} {kind} item(s) but the model at "
                                f"{self.model_path} has no {kind} tokens. Fix: use a model "
                                f"that reads {kind}s, or drop data.multimodal_keys.{kind}")
            if kind == "image":
                out, counts = self._images(refs)
            elif kind == "video":
                out, counts, seconds = self._videos(refs)
                if self.timestamps_videos():
                    tensors.update(out)
                    ids = expand_items(ids, self.pad_ids[kind],
                                       self._timestamped(out["video_grid_thw"], seconds),
                                       f"{where}, videos")
                    continue
            else:
                out, counts = self._audios(refs)
            tensors.update(out)
            ids = expand_pads(ids, self.pad_ids[kind], counts, f"{where}, {kind}s")
        return Processed(input_ids=ids, tensors=tensors)

    def _timestamped(self, grid: np.ndarray, seconds: Sequence[list[float]]) -> list[list[int]]:
        """Each video's Qwen3-VL expansion (`timestamped_video_tokens`)."""
        merge = int(getattr(self.image_processor(), "merge_size", 2))
        start, pad, end = self._marker_ids["video"]
        return [timestamped_video_tokens(secs, int(h * w) // (merge * merge), self.text_ids,
                                         start, pad, end)
                for (_, h, w), secs in zip(grid.tolist(), seconds)]

    def _images(self, refs: Sequence[MediaRef]) -> tuple[dict[str, np.ndarray], list[int]]:
        proc = self.image_processor()
        out = proc(images=[load_image(r) for r in refs], return_tensors="np",
                   **self._size_kwargs(proc))
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64)  # [n, 3]
        merge = int(getattr(proc, "merge_size", 2))
        counts = [int(n) for n in grid.prod(axis=1) // (merge * merge)]
        return {"pixel_values": np.ascontiguousarray(out["pixel_values"], np.float32),
                "image_grid_thw": grid}, counts

    def _videos(self, refs: Sequence[MediaRef]
                ) -> tuple[dict[str, np.ndarray], list[int], list[list[float]]]:
        """Each video's sampled frames through the image processor (resize, normalise,
        patches), then regrouped into the video layout (`video_patches`). Also returns each
        video's temporal patches' times in seconds (`frame_pair_seconds`)."""
        proc = self.image_processor()
        merge = int(getattr(proc, "merge_size", 2))
        temporal = int(getattr(proc, "temporal_patch_size", 2))
        patches, grids, seconds, times = [], [], [], []
        for ref in refs:
            frames = load_video(ref, self.limits.video)
            out = proc(images=frames.images, return_tensors="np",
                       **self._size_kwargs(proc, self.limits.video.max_pixels))
            _, grid_h, grid_w = (int(v) for v in np.asarray(out["image_grid_thw"])[0])
            pv, grid_t = video_patches(np.asarray(out["pixel_values"], np.float32),
                                       len(frames.images), temporal, int(proc.patch_size))
            patches.append(pv)
            grids.append([grid_t, grid_h, grid_w])
            seconds.append(temporal / frames.sampled_fps)
            times.append(frame_pair_seconds(frames.indices, frames.native_fps, temporal))
        grid = np.asarray(grids, dtype=np.int64)  # [n, 3]
        counts = [int(n) for n in grid.prod(axis=1) // (merge * merge)]
        out = {"pixel_values_videos": np.ascontiguousarray(np.concatenate(patches)),
               "video_grid_thw": grid}
        if not self.timestamps_videos():  # Qwen3-VL spaces frames by its timestamp text instead
            out[video_seconds_key(self.model_type)] = np.asarray(seconds, dtype=np.float32)
        return out, counts, times

    def _size_kwargs(self, proc: Any, max_pixels: int | None = None) -> dict[str, Any]:
        """The image pixel limits (or `max_pixels` for the largest size) as the Qwen-VL image
        processors take them."""
        kwargs = {}
        lo, hi = self.limits.image_min_pixels, max_pixels or self.limits.image_max_pixels
        if lo is not None or hi is not None:
            size = dict(getattr(proc, "size", None) or {})
            if lo is not None:
                size["shortest_edge"] = lo  # Qwen-VL processors: a pixel count, not an edge
            if hi is not None:
                size["longest_edge"] = hi
            kwargs["size"] = size
        return kwargs

    def _audios(self, refs: Sequence[MediaRef]) -> tuple[dict[str, np.ndarray], list[int]]:
        fe = self.feature_extractor()
        rate = self.limits.audio_sampling_rate_hz
        waves = [load_audio(r, rate) for r in refs]
        out = fe(waves, sampling_rate=rate, return_attention_mask=True, padding="max_length",
                 return_tensors="np")
        mask = np.asarray(out["attention_mask"], dtype=np.int64)  # [n, frames]
        counts = [audio_token_count(self.model_type, int(n)) for n in mask.sum(axis=1)]
        return {"input_features": np.ascontiguousarray(out["input_features"], np.float32),
                "feature_attention_mask": mask}, counts


def video_patches(frame_patches: np.ndarray, num_frames: int, temporal: int, patch_size: int
                  ) -> tuple[np.ndarray, int]:
    """Per-frame image patches -> video patches, as Qwen-VL's video processor lays them out.

    The image processor gives each frame's patches with the frame repeated `temporal` times
    ([F * S, C * temporal * P * P], S = grid_h * grid_w in merge-window order); a video patch
    holds `temporal` consecutive frames instead ([grid_t * S, C * temporal * P * P], frame
    pairs outer, the same spatial order inner). A frame count that is not a multiple of
    `temporal` is padded with the last frame. Returns (patches, grid_t).

    >>> f = np.arange(3 * 2, dtype=np.float32).reshape(3, 1, 2, 1)  # 3 frames, S=1, C=2
    >>> pv, t = video_patches(np.repeat(f, 2, axis=2).reshape(3, 4), 3, 2, 1)  # C=2, P=1
    >>> t, pv.tolist()
    (2, [[0.0, 2.0, 1.0, 3.0], [4.0, 4.0, 5.0, 5.0]])
    """
    per_frame = frame_patches.reshape(num_frames, -1, frame_patches.shape[1])  # [F, S, D]
    F, S, D = per_frame.shape
    # [F, S, C, T, P*P] -> [F, S, C, P*P]: the image processor's T copies of a frame are equal
    single = per_frame.reshape(F, S, -1, temporal, patch_size * patch_size)[:, :, :, 0]
    if pad := -F % temporal:
        single = np.concatenate([single, np.repeat(single[-1:], pad, axis=0)])
    grid_t = single.shape[0] // temporal
    # [grid_t, T, S, C, P*P] -> [grid_t, S, C, T, P*P]
    video = single.reshape(grid_t, temporal, S, single.shape[2], -1).transpose(0, 2, 3, 1, 4)
    return np.ascontiguousarray(video.reshape(grid_t * S, D)), grid_t


def _load_feature_extractor(path: str) -> Any:
    from transformers import AutoFeatureExtractor, AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(path)
        fe = getattr(proc, "feature_extractor", None)
        if fe is not None:
            return fe
    except (OSError, ValueError, ImportError, AttributeError):
        pass
    return AutoFeatureExtractor.from_pretrained(path)


def concat_tensors(per_sample: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Batch the samples' tensors: each name concatenated along dim 0 in sample order (what a
    Qwen-VL/Audio forward expects: items in the order of their pads in the flattened ids)."""
    names = sorted({k for t in per_sample for k in t})
    return {k: np.concatenate([t[k] for t in per_sample if k in t]) for k in names}
