"""Checkpoints across real processes: 2 torchrun ranks on gloo (DDP and FSDP2, and FSDP2 with
model.lora: the adapter's checkpoint, and the adapter and merged weights it sends, gathered
whole), and a process SIGKILLed in the middle of a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import (  # noqa: E402
    REPO_ROOT, child_env, run_logged, run_tiny_model_tool, stop_process,
)

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return run_tiny_model_tool(tmp_path_factory.mktemp("ckpt_dist") / "model")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("strategy,async_save,lora", [("ddp", False, False),
                                                      ("fsdp2", True, False),
                                                      ("fsdp2", False, True)])
def test_two_ranks_save_load_bitwise(tiny_dir, tmp_path, strategy, async_save, lora):
    root, out, log = tmp_path / "checkpoints", tmp_path / "result.json", tmp_path / "torchrun.log"
    # --standalone: a rendezvous on a port the OS picks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPTS / "ckpt_dist_roundtrip.py"), "--model-dir", str(tiny_dir),
           "--strategy", strategy, "--root", str(root), "--out", str(out)]
    cmd += ["--async-save"] * async_save + ["--lora"] * lora
    rc = run_logged(cmd, log, timeout_s=900)
    assert rc == 0, log.read_text()[-6000:]
    r = json.loads(out.read_text())
    assert r["latest"] == "step_2"
    assert r["n_optim_tensors"] > 24 and r["n_compared"] > 50
    assert r["mismatch_after_load"] == [], "model/optimizer state differs after load"
    assert r["mismatch_next_step"] == [], "one more step from the loaded state differs"
    assert r["sched_equal"] and r["rng_equal"]
    assert r["extra"]["broker"] == {"accepted": 9, "consumed": 8, "dropped": 1}
    assert r["extra"]["data"]["index"] == 8 and r["extra"]["step"] == 2
    assert r["dirs"] == ["latest", "step_2", "step_3"] and r["latest_after"] == "step_3"
    if lora:
        # A and B of 7 targets in each layer; every base weight once, merged or as it was
        assert r["adapter_names"] >= 28 and r["merged_names"] > 20, r
        assert r["adapter_mismatch"] == [] and r["merged_mismatch"] == [], r
        return

    # DCP reshards: the 2-rank checkpoint converts, and loads with its optimizer, in one process
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from relax_slurm.checkpoint import convert_checkpoint, load_checkpoint

    ref = load_file(str(tmp_path / "ref_step2.safetensors"))
    got = load_file(str(convert_checkpoint(root / "step_2", tmp_path / "hf") /
                        "model.safetensors"))
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load_checkpoint(root / "step_2", model, opt, None)["version"] == 2
    state = model.state_dict()
    assert all(torch.equal(ref[k], state[k]) for k in ref)
    assert len(opt.state) == len(ref) and all(int(s["step"]) == 2 for s in opt.state.values())


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage,expect", [
    ("write", "step_1"), ("before_rename", "step_1"), ("after_rename", "step_2"),
])
def test_sigkill_during_save_keeps_a_loadable_checkpoint(tmp_path, stage, expect):
    import torch
    from safetensors.torch import load_file

    from relax_slurm.checkpoint import find_latest, load_checkpoint, save_checkpoint

    sys.path.insert(0, str(SCRIPTS))
    from ckpt_kill_during_save import build_model

    root, marker, log = tmp_path / "checkpoints", tmp_path / "stalled", tmp_path / "saver.log"
    cmd = [sys.executable, str(SCRIPTS / "ckpt_kill_during_save.py"), "--root", str(root),
           "--stage", stage, "--marker", str(marker)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                cwd=str(REPO_ROOT), start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the save never reached " + stage
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)  # exactly the process we started
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        stop_process(proc)

    latest = find_latest(tmp_path)
    assert latest is not None and latest.name == expect
    assert (root / "latest").read_text().strip() == "step_1"  # never updated before the kill
    if expect == "step_1":
        assert (root / "step_2.tmp").is_dir() and not (root / "step_2").exists()
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load_checkpoint(latest, model, opt, None)["version"] == int(expect[-1])
    ref = load_file(str(tmp_path / f"ref_{expect.replace('_', '')}.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(ref[k], state[k]) for k in ref)

    # the next save cleans the leftovers and commits normally
    save_checkpoint(root, 3, model, opt, None, {"version": 3}, keep_last=3)
    assert find_latest(tmp_path).name == "step_3"
    assert not list(root.glob("*.tmp")) and not list(root.glob("*.del"))
