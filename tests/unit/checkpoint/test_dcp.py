"""save_checkpoint / load_checkpoint in one process (no process group): contents, commit,
pruning, async snapshot, errors. The 2-rank DDP/FSDP2 cases are tests/integration."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from relax_slurm.checkpoint import (
    CheckpointError, find_latest, load_checkpoint, read_meta, save_checkpoint, wait_pending,
)

torch.set_num_threads(1)


def build(model_dir, lr=1e-2):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train(model, opt, sched, seed=0):
    x = torch.randint(3, 18, (2, 10), generator=torch.Generator().manual_seed(seed))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def snapshot(model, opt):
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    return params, state


def assert_same(a, b):
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    for x, y in ((a[0], b[0]), (a[1], b[1])):
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_roundtrip_model_optimizer_scheduler_rng_extra(tiny_dir, tmp_path):
    model, opt, sched = build(tiny_dir)
    train(model, opt, sched)
    train(model, opt, sched, seed=1)
    ref = snapshot(model, opt)
    extra = {"version": 2, "data": {"epoch": 0, "index": 4, "seed": 1},
             "broker": {"accepted": 3, "consumed": 2, "dropped": 0}, "config": {"a": [1, 2]}}
    random.seed(5)
    np.random.seed(6)
    handle = save_checkpoint(tmp_path, 2, model, opt, sched, extra, keep_last=2,
                             hf_assets_src=tiny_dir)
    assert handle.done() and handle.wait() == tmp_path / "step_2"
    expect_rng = (torch.rand(3), random.random(), np.random.rand())

    model2, opt2, sched2 = build(tiny_dir, lr=0.5)
    train(model2, opt2, sched2, seed=9)  # different weights and optimizer state to overwrite
    torch.manual_seed(123)
    got = load_checkpoint(find_latest(tmp_path), model2, opt2, sched2)
    assert got == {**extra, "step": 2}
    assert_same(ref, snapshot(model2, opt2))
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    got_rng = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got_rng[0], expect_rng[0]) and got_rng[1:] == expect_rng[1:]

    ckpt = tmp_path / "step_2"
    meta = read_meta(ckpt)
    assert meta["step"] == 2 and meta["world_size"] == 1 and not meta["weights_only"]
    assert (ckpt / "hf" / "config.json").is_file() and (ckpt / "hf" / "tokenizer.json").is_file()
    assert (ckpt / "rng" / "rank_0.pt").is_file()
    assert (tmp_path / "latest").read_text().strip() == "step_2"


def test_keep_last_prunes_by_save_order_and_resave_replaces(tiny_dir, tmp_path):
    model, opt, sched = build(tiny_dir)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, sched, {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_4"]
    (tmp_path / "step_5.tmp").mkdir()  # leftover of a crashed save
    train(model, opt, sched)
    save_checkpoint(tmp_path, 4, model, opt, sched, {"again": True}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_4"]
    assert read_meta(tmp_path / "step_4")["extra_state"]["again"] is True
    # resumed from an older checkpoint: the new step_2 is the latest, the oldest save goes
    save_checkpoint(tmp_path, 2, model, opt, sched, {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2", "step_4"]
    assert find_latest(tmp_path) == tmp_path / "step_2"


def test_async_save_is_a_snapshot(tiny_dir, tmp_path):
    model, opt, sched = build(tiny_dir)
    train(model, opt, sched)
    ref = snapshot(model, opt)
    handle = save_checkpoint(tmp_path, 1, model, opt, sched, {"v": 1}, keep_last=1,
                             async_save=True)
    train(model, opt, sched, seed=3)  # changes weights while the write may be in flight
    train(model, opt, sched, seed=4)
    assert handle.wait(timeout_s=120) == tmp_path / "step_1"
    wait_pending()
    model2, opt2, sched2 = build(tiny_dir)
    load_checkpoint(tmp_path / "step_1", model2, opt2, sched2)
    assert_same(ref, snapshot(model2, opt2))
    # a second async save waits for the first; pruning keeps 1
    h2 = save_checkpoint(tmp_path, 2, model, opt, sched, {}, keep_last=1, async_save=True)
    h2.wait(timeout_s=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2"]


def test_extra_state_must_be_json(tiny_dir, tmp_path):
    model, opt, sched = build(tiny_dir)
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(tmp_path, 1, model, opt, sched, {"t": torch.zeros(1)}, keep_last=1)
    assert not (tmp_path / "step_1").exists() and not (tmp_path / "step_1.tmp").exists()


def test_load_errors(tiny_dir, tiny_small_dir, tmp_path):
    model, opt, sched = build(tiny_dir)
    save_checkpoint(tmp_path, 1, model, opt, sched, {}, keep_last=1)
    small, sopt, ssched = build(tiny_small_dir)
    with pytest.raises(CheckpointError, match="same model architecture"):
        load_checkpoint(tmp_path / "step_1", small, sopt, ssched)
    (tmp_path / "step_1" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_1", model, opt, sched)
    assert find_latest(tmp_path) is None


def test_load_without_optimizer(tiny_dir, tmp_path):
    model, opt, sched = build(tiny_dir)
    train(model, opt, sched)
    save_checkpoint(tmp_path, 1, model, opt, sched, {}, keep_last=1)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert load_checkpoint(tmp_path / "step_1", fresh, None, None) == {"step": 1}
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    json.loads((tmp_path / "step_1" / "meta.json").read_text())
