"""Where the towers of a multimodal model run under trainer=megatron at TP=2: the tiny
Qwen3-Omni thinker (experiment=tiny_vl_cpu with the tone task's audio rows beside the colour
task's image rows, as tests/integration/test_megatron_omni.py trains it) with
trainer.towers=replicated (every TP rank encodes every image and audio) and split (each rank
its share, the features all-gathered: trainer/megatron/tower_split.py), interleaved repeats of
the same run.

The figures: median trainer time and step time per step of split over replicated, measured in
this invocation. The rollout side is the same in both modes; what differs is the trainer's
forward and backward of the towers (the micro-batch's media, 16 samples a prompt each with its
own copy of the prompt's media) against the all-gather of their features.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common import REPO, Run, relax_train, spread

from relax_slurm.tiny.media_tasks import mix_rows

MODES = ("replicated", "split")
TASKS = {"colors": "images", "tones": "audios"}


def make_omni(out: Path) -> tuple[Path, Path]:
    """The tiny Qwen3-Omni and its image + audio rows (the real tools), built once."""
    model, data = out / "omni3_model", out / "omni_train.jsonl"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", str(model),
                        "--kind", "omni3"], cwd=REPO, check=True, capture_output=True)
    if not data.exists():
        for task in TASKS:
            if not (out / f"{task}_train.jsonl").exists():
                subprocess.run([sys.executable, "tools/prepare_mm_data.py", "--out", str(out),
                                "--task", task], cwd=REPO, check=True, capture_output=True)
        mix_rows(out, TASKS, data)
    return model, data


def measure(out: Path, steps: int, repeats: int) -> dict:
    model, data = make_omni(out / "assets")
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    for rep in range(repeats):
        for mode in MODES:  # interleaved: drift hits both modes alike
            run = relax_train(out / "towers" / f"{mode}_rep{rep}", model, data,
                              f"trainer.total_steps={steps}", "trainer=megatron",
                              "trainer.nproc_per_node=2", "trainer.tensor_parallel_size=2",
                              "trainer.lr=1e-2", "+data.multimodal_keys.audio=audios",
                              f"trainer.towers={mode}", experiment="tiny_vl_cpu")
            print(f"  towers {mode} rep {rep}: train {run.median('perf/train_time_s'):.3f} s, "
                  f"step {run.median('perf/step_time_s'):.3f} s", flush=True)
            runs[mode].append(run)
    return summarize(runs)


def summarize(runs: dict[str, list[Run]]) -> dict:
    """Per mode, then split over replicated for repeat i's pair, min / median / max."""
    res: dict = {"modes": {}}
    for mode, rs in runs.items():
        res["modes"][mode] = {"train_s": spread([r.median("perf/train_time_s") for r in rs]),
                              "step_s": spread([r.median("perf/step_time_s") for r in rs]),
                              "final_reward": spread([r.final_reward() for r in rs])}
    pairs = list(zip(runs["split"], runs["replicated"]))
    res["split_train_ratio"] = spread([s.median("perf/train_time_s")
                                       / r.median("perf/train_time_s") for s, r in pairs])
    res["split_step_ratio"] = spread([s.median("perf/step_time_s")
                                      / r.median("perf/step_time_s") for s, r in pairs])
    return res
