"""tools/make_tiny_model.py and tools/prepare_data.py, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    stdout = run_tool("tools/make_tiny_model.py", "--out", str(out / "model"))
    assert "parameters" in stdout and str(out / "model") in stdout
    run_tool("tools/prepare_data.py", "--out", str(out), "--n-train", "300", "--n-test", "50")
    return out


def test_prepare_data_rows(tiny):
    train = [json.loads(line) for line in (tiny / "arith_train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (tiny / "arith_test.jsonl").read_text().splitlines()]
    assert (len(train), len(test)) == (300, 50)
    for row in train + test:
        a, b = int(row["prompt"][0]), int(row["prompt"][2])
        assert row["prompt"] == f"{a}+{b}=" and row["label"] == str((a + b) % 10)
        assert a <= 4 and b <= 4  # the default --max-operand
    assert len({r["id"] for r in train + test}) == 350
    assert len({r["prompt"] for r in train}) == 25  # 300 draws cover the 5x5 table


def test_prepare_data_full_table_and_bad_operand(tmp_path):
    run_tool("tools/prepare_data.py", "--out", str(tmp_path), "--n-train", "2000", "--n-test",
             "0", "--max-operand", "9")
    rows = [json.loads(x) for x in (tmp_path / "arith_train.jsonl").read_text().splitlines()]
    assert len({r["prompt"] for r in rows}) == 100
    assert any(int(r["prompt"][0]) + int(r["prompt"][2]) >= 10 for r in rows)
    r = subprocess.run([sys.executable, "tools/prepare_data.py", "--out", str(tmp_path),
                        "--max-operand", "12"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0 and "--max-operand must be a digit" in r.stderr


def test_prepare_data_longtail_task(tmp_path):
    run_tool("tools/prepare_data.py", "--task", "longtail", "--out", str(tmp_path), "--n-train",
             "50", "--n-test", "5")
    rows = [json.loads(x) for x in (tmp_path / "longtail_train.jsonl").read_text().splitlines()]
    assert len(rows) == 50 and all(r["label"] == r["prompt"][0] * len(r["label"]) for r in rows)
    assert not (tmp_path / "arith_train.jsonl").exists()
    r = subprocess.run([sys.executable, "tools/prepare_data.py", "--task", "lengthy", "--out",
                        str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0 and "arith, longtail" in r.stderr


def test_model_and_tokenizer_load_and_generate(tiny):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    assert 50_000 < model.num_parameters() < 150_000

    ids = tok.apply_chat_template([{"role": "user", "content": "3+4="}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == tok("3+4=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tok.unk_token_id not in ids
    assert tok.decode(tok("3+4=7 ")["input_ids"]) == "3+4=7 "
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == "3+4="
    convo = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    assert tok.apply_chat_template(convo, tokenize=False) == "3+4=7<eos>"

    for cfg in (model.config, model.generation_config):
        assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (
            tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)

    batch = tok(["3+4=", "12+5="], return_tensors="pt", padding=True)  # left-padded
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 5 + 3) and out.dtype == torch.long


def test_build_model_is_seeded():
    from relax_slurm.tiny.model import build_model, build_tokenizer

    tok = build_tokenizer()
    a, b, c = (build_model(tok, seed=s).state_dict() for s in (0, 0, 1))
    assert all(a[k].equal(b[k]) for k in a)
    assert not a["model.layers.0.self_attn.q_proj.weight"].equal(
        c["model.layers.0.self_attn.q_proj.weight"])


def test_data_pipeline_reads_the_tool_output(tiny):
    from transformers import AutoTokenizer

    from relax_slurm.config.data import DataConfig
    from relax_slurm.data import PromptDataset

    tok = AutoTokenizer.from_pretrained(tiny / "model")
    ds = PromptDataset(DataConfig(train_files=[str(tiny / "arith_train.jsonl")]), tok)
    p = next(ds)
    assert len(ds) == 300 and len(p.input_ids) == 4 and p.text.endswith("=")


def test_multimodal_tools_load_back(tiny_mm_assets):
    """The tiny VL (Qwen2.5-VL, Qwen3-VL) and audio models load with the Auto classes; the
    tasks' files exist."""
    import json as _json

    from transformers import (AutoImageProcessor, AutoModelForMultimodalLM, AutoProcessor,
                              AutoTokenizer)

    vl, audio = tiny_mm_assets / "vl_model", tiny_mm_assets / "audio_model"
    assert type(AutoModelForMultimodalLM.from_pretrained(vl)).__name__ == \
        "Qwen2_5_VLForConditionalGeneration"
    assert type(AutoModelForMultimodalLM.from_pretrained(audio)).__name__ == \
        "Qwen2AudioForConditionalGeneration"
    assert AutoImageProcessor.from_pretrained(vl).size["longest_edge"] == 56 * 56
    assert AutoProcessor.from_pretrained(audio).feature_extractor.nb_max_frames == 200
    assert "<|image_pad|>" in AutoTokenizer.from_pretrained(vl).get_vocab()
    vl3 = tiny_mm_assets / "vl3_model"
    assert type(AutoModelForMultimodalLM.from_pretrained(vl3)).__name__ == \
        "Qwen3VLForConditionalGeneration"
    assert AutoImageProcessor.from_pretrained(vl3).patch_size == 16
    tok3 = AutoTokenizer.from_pretrained(vl3)  # Qwen3-VL's video timestamps are text
    assert tok3.decode(tok3("<0.5 seconds>")["input_ids"]) == "<0.5 seconds>"
    for task, column in (("colors", "images"), ("change", "videos"), ("tones", "audios")):
        rows = [_json.loads(x) for x in (tiny_mm_assets / f"{task}_train.jsonl").open()]
        assert len(rows) == 2000 and {r["label"] for r in rows} == {"0", "1", "2", "3"}
        assert all((tiny_mm_assets / r[column][0]).is_file() for r in rows[:50])


def test_change_clips_turn_colour_halfway(tiny_mm_assets):
    """The video task's clips: 4 frames, the first pair one colour, the last pair another."""
    import json as _json

    import numpy as np

    from relax_slurm.data.media import MediaRef
    from relax_slurm.data.video import VideoLimits, load_video

    row = _json.loads((tiny_mm_assets / "change_train.jsonl").open().readline())
    clip = load_video(MediaRef(kind="video", path=str(tiny_mm_assets / row["videos"][0])),
                      VideoLimits(fps=4.0, min_frames=4, max_frames=4))
    px = [np.asarray(im, np.int64)[28, 28] for im in clip.images]
    assert len(px) == 4 and clip.sampled_fps == 4.0
    assert np.abs(px[0] - px[1]).max() < 12 and np.abs(px[2] - px[3]).max() < 12  # lossy
    assert np.abs(px[1] - px[2]).max() > 60


def test_suite_cpu_charges_a_tests_child_processes_to_it(tmp_path):
    """tools/suite_cpu.py as docs/development.md runs it: a test whose child burns ~1 CPU-s
    is charged that second (RUSAGE_CHILDREN), a test that only sleeps is charged ~none."""
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys, time\n"
        "def test_child_burns():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt=time.process_time()\\n"
        "while time.process_time() - t < 1.0: pass'], check=True)\n"
        "def test_sleeps():\n"
        "    time.sleep(0.5)\n")
    out = tmp_path / "cpu"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tools"),
           "CPU_PROFILE_DIR": str(out), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), "test_burn.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["id"].split("::")[1]: r for r in map(json.loads,
                                                   (out / "main.jsonl").read_text().splitlines())}
    assert rows["test_child_burns"]["cpu_s"] >= 1.0  # the child's own second, reaped
    assert rows["test_sleeps"]["cpu_s"] < 0.4 and rows["test_sleeps"]["wall_s"] >= 0.5
    report = run_tool("tools/suite_cpu.py", str(out))
    assert "2 tests" in report and "test_burn.py" in report
    assert "main: busy" in report  # the worker's timeline
