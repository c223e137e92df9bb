"""SFT end to end: `experiment=tiny_sft_cpu` teaches the tiny model the arith answers ("3+4=" ->
"7<eos>") as supervised targets, with the trainer alone; then RL starts from its HF export.

Measured on this machine (2 cores, shared): the SFT run takes ~15 s (80 steps of 64 rows, one
pass over the data); validation NLL 3.0 -> 0.083 (36x); greedy answers right and stopped on
25 of 25 distinct held-out prompts (the untrained model: 0). The RL run from the export starts at
reward 0.85 (from tiny/model: ~0.01) at trainer.lr=2e-4 (the tiny_cpu preset's 2e-3 drops it to
~0.5 after one step: a fresh Adam moves every weight by ~lr at once).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax_slurm.checkpoint.cli import main as convert_main

from tests.conftest import NEEDS_MEGATRON, ONE_RANK, REPO, run_env, tiny_command

RUN_TIMEOUT_S = 600
STEPS = 80
NLL_FALL = 8.0       # measured 36x
GREEDY_RIGHT = 0.8   # measured 25 of 25
RL_REWARD_FIRST = 0.6  # measured 0.85; the untrained model's is ~0.01


def sft(run_dir: Path, tiny: Path, *overrides: str) -> list[dict]:
    """A tiny_sft_cpu run to its end; its metrics rows."""
    proc = subprocess.run(
        tiny_command(run_dir, tiny, "metrics.progress=false", *overrides,
                     experiment="tiny_sft_cpu"),
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return rows_of(run_dir)


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(path),
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())


@torch.no_grad()
def val_nll(model_dir: Path, data: Path) -> float:
    """Token-mean NLL of the answers and their EOS, computed here independently of the trainer:
    prompt and answer rendered by the chat template, as the rollout does. One forward per
    length (the tiny task's rows all have one)."""
    tok, model = load(model_dir)
    by_len: dict[tuple[int, int], list[list[int]]] = {}
    for row in map(json.loads, data.read_text().splitlines()):
        chat = [{"role": "user", "content": row["prompt"]}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template([*chat, {"role": "assistant", "content": row["label"]}],
                                       tokenize=False)
        p = len(tok(prompt, add_special_tokens=False)["input_ids"])
        ids = tok(full, add_special_tokens=False)["input_ids"]
        by_len.setdefault((p, len(ids)), []).append(ids)
    nll, tokens = 0.0, 0
    for (p, _), rows in by_len.items():
        ids = torch.tensor(rows)  # [B, T]
        logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
        picked = logp.gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
        nll -= picked[:, p - 1:].sum().item()
        tokens += picked[:, p - 1:].numel()
    return nll / tokens


@torch.no_grad()
def greedy_right(model_dir: Path, data: Path) -> float:
    """Share of the distinct prompts whose greedy answer is the label, then EOS (one batched
    generate: the tiny prompts all have one length)."""
    tok, model = load(model_dir)
    pairs = sorted({(r["prompt"], r["label"])
                    for r in map(json.loads, data.read_text().splitlines())})
    prompts = torch.tensor([tok.apply_chat_template([{"role": "user", "content": p}],
                                                    add_generation_prompt=True, tokenize=True,
                                                    return_dict=False) for p, _ in pairs])
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=3,
                         do_sample=False)
    answers = out[:, prompts.shape[1]:prompts.shape[1] + 2].tolist()
    right = sum(a == tok(label, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                for a, (_, label) in zip(answers, pairs))
    return right / len(pairs)


@pytest.mark.slow
def test_sft_warm_start_then_rl_from_its_export(tmp_path, tiny_assets):
    sft_dir, test_file = tmp_path / "sft", tiny_assets / "arith_test.jsonl"
    proc = subprocess.run(
        tiny_command(sft_dir, tiny_assets, "metrics.progress=false",
                     f"sft.val_files=[{test_file}]", experiment="tiny_sft_cpu"),
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the trainer alone: no broker, engine or rollout worker was started
    assert [r["name"] for r in json.loads((sft_dir / "roles.json").read_text())] == ["trainer"]
    assert sorted(p.name for p in (sft_dir / "logs").iterdir()) == ["trainer.log"]
    rows = rows_of(sft_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows[-1]["sft/epoch"] == pytest.approx(STEPS * 64 / 5000)
    vals = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(vals) == STEPS // 10 and vals == sorted(vals, reverse=True)

    export = sft_dir / "hf" / f"step_{STEPS}"
    before = val_nll(tiny_assets / "model", test_file)
    after = val_nll(export, test_file)
    # the trainer's validation and this independent one agree on the exported weights
    assert vals[-1] == pytest.approx(after, rel=1e-4)
    assert after * NLL_FALL <= before, (before, after)
    assert greedy_right(export, test_file) >= GREEDY_RIGHT
    assert greedy_right(tiny_assets / "model", test_file) < 0.2
    assert (sft_dir / "checkpoints" / f"step_{STEPS}").is_dir()
    # relax-convert turns any of its checkpoints into such an export: the last one, bitwise
    assert convert_main(["--input", str(sft_dir / "checkpoints" / f"step_{STEPS}"),
                         "--output", str(tmp_path / "converted"), "--no-progress"]) == 0
    ours, theirs = (load_file(d / "model.safetensors") for d in (tmp_path / "converted", export))
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    summary = json.loads((sft_dir / "summary.json").read_text())
    assert summary["val_loss_first"] == vals[0] and summary["val_loss_last"] == vals[-1]

    # RL from the export (model.path): engines and trainer both load it
    rl_dir = tmp_path / "rl"
    cmd = [a for a in tiny_command(rl_dir, tiny_assets, ONE_RANK, "metrics.progress=false",
                                   "trainer.total_steps=3", "trainer.lr=2e-4")
           if not a.startswith("model.path=")] + [f"model.path={export}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rl = rows_of(rl_dir)
    assert len(rl) == 3
    assert rl[0]["rollout/reward_mean"] >= RL_REWARD_FIRST, rl[0]
    assert rl[0]["train/rollout_train_logprob_diff"] < 1e-3  # same weights on both sides


@pytest.mark.slow
def test_sft_resumes_exactly_where_its_checkpoint_left(tmp_path, tiny_assets):
    """A run resumed from a straight run's mid-run checkpoint trains the same rows (the data
    position rides in the checkpoint) with the same weights: its steps repeat bit for bit. Two
    DDP ranks, as the other exact-resume tests: rows and the padded validation rows are split
    over both."""
    common = (f"sft.val_files=[{tiny_assets / 'arith_test.jsonl'}]", "sft.val_every=6",
              "trainer.total_steps=12", "sft.batch_size=512", "trainer.nproc_per_node=2")
    straight = sft(tmp_path / "straight", tiny_assets, *common, "trainer.save_every=6")
    resumed = sft(tmp_path / "resumed", tiny_assets, *common,
                  f"resume={tmp_path / 'straight' / 'checkpoints' / 'step_6'}")
    assert [r["step"] for r in resumed] == list(range(6, 12))
    # 12 x 512 rows cross the 5000-row epoch end after the resume point (6 x 512)
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in straight[6:]]
    assert resumed[-1]["sft/epoch"] == straight[-1]["sft/epoch"]
    assert resumed[-1]["val/loss"] == straight[-1]["val/loss"] < straight[5]["val/loss"]


@pytest.mark.slow
@NEEDS_MEGATRON
def test_sft_under_megatron_trains_as_under_torch(tmp_path, tiny_assets):
    """The loss is the shared token_loss on either backend: same rows, same start,
    same first loss (float32 summation order) and the same descent; the validation forward
    (Megatron's forward-only schedule) scores the held-out rows alike. Measured: every one of
    the 10 losses within 1.1e-7 relative, val/loss within 7e-8 (80 steps: 2.4e-4, Adam
    amplifying rounding)."""
    common = (f"sft.val_files=[{tiny_assets / 'arith_test.jsonl'}]", "trainer.total_steps=10")
    torch_rows = sft(tmp_path / "torch", tiny_assets, *common)
    meg_rows = sft(tmp_path / "megatron", tiny_assets, *common, "trainer=megatron",
                   ONE_RANK)
    assert meg_rows[0]["train/loss"] == pytest.approx(torch_rows[0]["train/loss"], rel=1e-5)
    # later steps start from weights that differ by rounding-level updates: same learning
    assert meg_rows[-1]["train/loss"] == pytest.approx(torch_rows[-1]["train/loss"], rel=1e-2)
    assert meg_rows[-1]["train/loss"] < 0.8 * meg_rows[0]["train/loss"]
    # validation through Megatron's forward-only schedule
    assert meg_rows[-1]["val/tokens"] == torch_rows[-1]["val/tokens"] == 1000
    assert meg_rows[-1]["val/loss"] == pytest.approx(torch_rows[-1]["val/loss"], rel=1e-2)
    assert (tmp_path / "megatron" / "hf" / "step_10" / "config.json").is_file()
