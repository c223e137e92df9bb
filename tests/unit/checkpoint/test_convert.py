"""Conversion: DCP -> HF gives the trainer's logits exactly, HF -> DCP -> HF is byte-identical,
format detection, architecture checks, dtype, the Megatron path, save_hf, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from relax_slurm.checkpoint import (
    CheckpointError, convert_checkpoint, detect_format, load_checkpoint, save_checkpoint, save_hf,
)
from relax_slurm.checkpoint import from_dcp
from relax_slurm.checkpoint.cli import main as cli_main

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[3]
X = torch.tensor([[3, 4, 13, 5, 15, 9, 1], [7, 7, 14, 8, 15, 3, 3]])


def trained(model_dir) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=X, labels=X).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=X).logits


def hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.fixture(scope="module")
def run_dir(tiny_dir, tmp_path_factory):
    """A run directory with one checkpoint of a model trained one step, and its logits."""
    run = tmp_path_factory.mktemp("run")
    model, opt = trained(tiny_dir)
    save_checkpoint(run / "checkpoints", 1, model, opt, None, {"version": 1}, keep_last=1,
                    hf_assets_src=tiny_dir)
    return run, logits(model)


def test_dcp_to_hf_gives_the_trainers_logits_exactly(run_dir, tmp_path):
    run, ref = run_dir
    out = convert_checkpoint(run, tmp_path / "hf")  # a run dir means its latest checkpoint
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors",
                                               "tokenizer.json", "generation_config.json"}
    assert "lm_head.weight" not in hf_tensors(out)  # tied, stored once as HF does
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(loaded), ref)
    # the mode the umask gives new files (safetensors itself writes 0600): readable on a
    # shared cluster by whoever may read the directory
    umask = os.umask(0)
    os.umask(umask)
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {
        f.name: 0o666 & ~umask for f in out.iterdir()}


def test_hf_to_dcp_to_hf_is_byte_identical(tiny_dir, tmp_path):
    assert detect_format(tiny_dir)[0] == "hf"
    dcp_dir = convert_checkpoint(tiny_dir, tmp_path / "dcp")
    assert detect_format(dcp_dir) == ("dcp", dcp_dir)
    back = convert_checkpoint(dcp_dir, tmp_path / "hf", shard_size_mb=0.05)
    assert (back / "model.safetensors.index.json").is_file()  # several shards
    a, b = hf_tensors(tiny_dir), hf_tensors(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].numpy().tobytes() == b[k].numpy().tobytes(), k
    assert AutoModelForCausalLM.from_pretrained(back) is not None


def test_hf_to_dcp_loads_as_weights_only_checkpoint(tiny_dir, tmp_path):
    dcp_dir = convert_checkpoint(tiny_dir, tmp_path / "dcp")
    model, opt = trained(tiny_dir)  # weights differ from the file now
    lr_before = opt.param_groups[0]["lr"]
    assert load_checkpoint(dcp_dir, model, opt, None)["step"] == 0
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    assert opt.param_groups[0]["lr"] == lr_before and len(opt.state) > 0  # left alone


def test_dtype_option(run_dir, tmp_path):
    run, ref = run_dir
    out = convert_checkpoint(run / "checkpoints" / "step_1", tmp_path / "bf16", dtype="bfloat16")
    assert {t.dtype for t in hf_tensors(out).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    assert torch.allclose(logits(loaded).float(), ref, atol=0.1)
    with pytest.raises(CheckpointError, match="--dtype"):
        convert_checkpoint(run, tmp_path / "x", dtype="int8")


def test_refuses_mismatched_architecture(run_dir, tiny_dir, tiny_small_dir, tmp_path):
    run, _ = run_dir
    with pytest.raises(CheckpointError, match="does not match the architecture") as e:
        convert_checkpoint(run, tmp_path / "out", hf_config=tiny_small_dir)
    assert "shapes" in str(e.value) and "--hf-config" in str(e.value)
    assert not (tmp_path / "out").exists()
    # HF weights that do not fit their own config.json
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_bytes((tiny_small_dir / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="does not match the architecture"):
        convert_checkpoint(bad, tmp_path / "out2")


def test_output_and_target_checks(run_dir, tmp_path, monkeypatch):
    run, _ = run_dir
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with monkeypatch.context() as m:  # refused before the checkpoint is read
        m.setattr(from_dcp, "load_config", lambda *a: pytest.fail("read the input first"))
        with pytest.raises(CheckpointError, match="--overwrite"):
            convert_checkpoint(run, out)
    convert_checkpoint(run, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    with pytest.raises(CheckpointError, match="already in dcp format"):
        convert_checkpoint(run, tmp_path / "o2", to="dcp")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint format recognised"):
        detect_format(tmp_path / "empty")


def fake_megatron(root: Path) -> Path:
    it = root / "iter_0000010"
    it.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                  "sharded_backend_version": 1}))
    (it / ".metadata").write_bytes(b"")  # torch_dist is DCP underneath: must still say megatron
    (it / "common.pt").write_bytes(b"")
    return it


def test_megatron_detected_and_needs_the_bridge(tmp_path, monkeypatch):
    it = fake_megatron(tmp_path / "mcore")
    assert detect_format(tmp_path / "mcore") == ("megatron", it)
    assert detect_format(it) == ("megatron", it)
    monkeypatch.setitem(sys.modules, "megatron", None)  # as on a machine without it
    with pytest.raises(CheckpointError, match=r"megatron-bridge.*pip install -e '\.\[gpu\]'.*"
                                              r"pip install --no-deps megatron-bridge=="):
        convert_checkpoint(it, tmp_path / "hf", hf_config="Qwen/Qwen3-4B")


def test_the_backends_converters_are_registered_as_setup_cfg_says():
    """checkpoint/ finds the megatron converter and its adapter reader only through entry
    points: each group setup.cfg declares is installed and loads a function."""
    import configparser
    import importlib.metadata

    from relax_slurm.checkpoint.from_megatron import ADAPTER_READERS, CONVERTERS

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    for group in (CONVERTERS, ADAPTER_READERS):
        declared = dict(line.split(" = ") for line in
                        cfg["options.entry_points"][group].strip().splitlines())
        installed = {e.name: e for e in importlib.metadata.entry_points(group=group)}
        assert {n: e.value for n, e in installed.items()} == declared, (
            f"{group}: the installed metadata is stale; pip install -e .")
        assert all(callable(e.load()) for e in installed.values())


def test_save_hf_of_a_live_model(tiny_dir, tmp_path):
    model, _ = trained(tiny_dir)
    ref = logits(model)
    out = save_hf(model, tiny_dir, tmp_path / "hf" / "step_1")
    assert out == tmp_path / "hf" / "step_1" and (out / "tokenizer.json").is_file()
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), ref)
    save_hf(model, tiny_dir, out, dtype="bfloat16")  # replaces the older export
    assert {t.dtype for t in hf_tensors(out).values()} == {torch.bfloat16}


def test_cli(run_dir, tmp_path, capsys):
    run, ref = run_dir
    assert cli_main(["--input", str(run), "--output", str(tmp_path / "a"), "--no-progress"]) == 0
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "a")), ref)
    assert cli_main(["--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "b")]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_tool_script_runs(run_dir, tmp_path):
    run, _ = run_dir
    proc = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", "--input", str(run), "--output",
         str(tmp_path / "hf"), "--dtype", "float32"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()
