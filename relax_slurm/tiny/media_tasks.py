"""Write the multimodal tasks of the tiny CPU demos: coloured squares, colour changes, tones,
videos with sound.

    python tools/prepare_mm_data.py --out tiny --task colors   # tiny/colors_{train,test}.jsonl
    python tools/prepare_mm_data.py --out tiny --task change   # tiny/change_{train,test}.jsonl
    python tools/prepare_mm_data.py --out tiny --task tones    # tiny/tones_{train,test}.jsonl
    python tools/prepare_mm_data.py --out tiny --task sounding # tiny/sounding_{train,test}.jsonl

colors: PNG images (56x56, rendered with PIL) of one of 4 colours (red, green, blue, yellow) in
5 shades each, under OUT/colors/; a row is {"prompt": "<image>=", "images": ["colors/red_2.png"],
"label": "0", "id": ...}: the label is the colour's index. The answer depends on the image alone,
which is what makes the task visual; with a vocabulary of 20-odd characters a random tiny
Qwen2.5-VL first learns to answer with one of the 4 digits, then which one.
change: 1 s H.264 mp4 clips (4 frames of 56x56 at 4 fps, encoded with PyAV) of a whole frame
that turns from one of the 4 colours into another halfway (frames 0-1, then 2-3), in 3 shades,
under OUT/change/; rows {"prompt": "<video>=", "videos": ["change/red_to_blue_2.mp4"],
"label": "2"}: the label is the final colour's index. Both colours are in the clip: only which
one comes last tells the answer (a model blind to frame order gets 0.5 at best). Digits rather
than words: a random character-level model never writes a whole word, so GRPO would see no
reward at all.
tones: 1 s WAV files at 16 kHz (numpy sine, 16-bit PCM) of one of 4 frequencies (220, 440, 880,
1760 Hz) at 5 loudness levels, under OUT/tones/; rows {"prompt": "<audio>=", "audios":
["tones/440_3.wav"], "label": "1"}.
sounding: 1 s clips with sound (.mkv: 4 frames of 56x56 at 4 fps, MPEG-4 or H.264, and the tone
task's tones as a 16 kHz PCM track) under OUT/sounding/; rows {"prompt": "<video>=", "videos":
["sounding/440_3.mkv"], "label": "1"}: the label is the tone's index, the frames' colour
(one of the 4, by loudness) says nothing of it, so only a model that hears the video's sound
(data.audio_from_video=true) can answer.
Paths in rows are relative to the jsonl file's folder (see docs/multimodal.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import wave
from pathlib import Path

import numpy as np

COLORS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220),
          "yellow": (230, 220, 30)}
TONES_HZ = (220, 440, 880, 1760)
SHADES = 5
SAMPLE_RATE_HZ = 16000


def write_colors(folder: Path) -> list[tuple[str, str]]:
    """One PNG per colour and shade; [(relative path, label)]."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for label, (name, rgb) in enumerate(COLORS.items()):
        for shade in range(SHADES):
            scale = 0.6 + 0.1 * shade
            color = tuple(min(255, int(c * scale)) for c in rgb)
            path = folder / f"{name}_{shade}.png"
            Image.new("RGB", (56, 56), color).save(path)
            items.append((f"{folder.name}/{path.name}", str(label)))
    return items


CLIP_FRAMES, CLIP_FPS = 4, 4


def write_change(folder: Path) -> list[tuple[str, str]]:
    """One mp4 per (first colour, last colour) pair and shade; [(relative path, label)]."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
    from relax_slurm.data.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for first, rgb_first in COLORS.items():
        for label, (last, rgb_last) in enumerate(COLORS.items()):
            if first == last:
                continue
            for shade in (0, 2, 4):
                scale = 0.6 + 0.1 * shade
                colors = [tuple(min(255, int(c * scale)) for c in rgb)
                          for rgb in (rgb_first, rgb_last)]
                frames = [np.full((56, 56, 3), colors[t >= CLIP_FRAMES // 2], np.uint8)
                          for t in range(CLIP_FRAMES)]
                path = folder / f"{first}_to_{last}_{shade}.mp4"
                write_video(path, frames, CLIP_FPS)
                items.append((f"{folder.name}/{path.name}", str(label)))
    return items


def write_wav(path: Path, samples: np.ndarray, rate_hz: int = SAMPLE_RATE_HZ) -> None:
    """Mono 16-bit PCM WAV from floats in [-1, 1] (standard library `wave`)."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate_hz)
        w.writeframes(pcm.tobytes())


def tone(hz: float, level: int, seconds: float = 1.0) -> np.ndarray:
    """A sine at `hz`, loudness `level` (0..SHADES-1), at SAMPLE_RATE_HZ."""
    t = np.arange(int(seconds * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
    return (0.2 + 0.15 * level) * np.sin(2 * np.pi * hz * t)


def write_tones(folder: Path, seconds: float = 1.0) -> list[tuple[str, str]]:
    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for label, hz in enumerate(TONES_HZ):
        for level in range(SHADES):
            path = folder / f"{hz}_{level}.wav"
            write_wav(path, tone(hz, level, seconds))
            items.append((f"{folder.name}/{path.name}", str(label)))
    return items


def write_sounding(folder: Path) -> list[tuple[str, str]]:
    """One .mkv per tone and loudness: the tone task's sound as the track of a 1 s clip whose
    colour (one of the 4, by loudness) says nothing of the label; [(relative path, label)]."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
    from relax_slurm.data.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    colors = list(COLORS.values())
    items = []
    for label, hz in enumerate(TONES_HZ):
        for level in range(SHADES):
            frames = [np.full((56, 56, 3), colors[level % len(colors)], np.uint8)] * CLIP_FRAMES
            path = folder / f"{hz}_{level}.mkv"
            write_video(path, frames, CLIP_FPS, audio=(tone(hz, level), SAMPLE_RATE_HZ))
            items.append((f"{folder.name}/{path.name}", str(label)))
    return items


def prepare(out: Path, task: str, n_train: int = 2000, n_test: int = 200, seed: int = 0
            ) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write, placeholder, column = {"colors": (write_colors, "<image>", "images"),
                                  "change": (write_change, "<video>", "videos"),
                                  "tones": (write_tones, "<audio>", "audios"),
                                  "sounding": (write_sounding, "<video>", "videos")}[task]
    items = write(out / task)
    rng = random.Random(seed)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        path = out / f"{task}_{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for i in range(n):
                media, label = rng.choice(items)
                f.write(json.dumps({"prompt": f"{placeholder}=", column: [media], "label": label,
                                    "id": f"{split}-{i}"}) + "\n")
        paths.append(path)
    return paths


def mix_rows(folder: Path, tasks: dict[str, str], out: Path, split: str = "train",
             seed: int = 0) -> Path:
    """The `split` rows of `tasks` (task -> its media column, each task prepared in `folder`)
    shuffled into one file `out`: each row with every column (an empty list for the other
    kinds), its id prefixed with its task, its media paths made absolute (so `out` may live
    anywhere). The mixed image + audio rows the omni thinker trains on."""
    rows = []
    for task, column in tasks.items():
        for line in (folder / f"{task}_{split}.jsonl").read_text().splitlines():
            row = json.loads(line)
            row[column] = [str(folder / x) for x in row[column]]
            rows.append({**{c: [] for c in tasks.values()}, **row, "id": f"{task}-{row['id']}"})
    random.Random(seed).shuffle(rows)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write files into")
    parser.add_argument("--task", choices=["colors", "change", "tones", "sounding"],
                        default="colors")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, test = prepare(Path(args.out), args.task, args.n_train, args.n_test, args.seed)
    print(f"wrote {train} and {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
