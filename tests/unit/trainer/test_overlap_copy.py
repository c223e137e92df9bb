"""An overlapped push's whole copy of the weights (trainer/overlap.py): where the export is
gathered through every rank (FSDP2, megatron) rank 0 keeps the served weights in host memory
while the next step trains; a copy that would not fit in half of the host's available memory
falls back to the inline, streamed push (issue #34: rank 0 held the whole model)."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from relax_slurm.config import register_configs, to_train_config
from relax_slurm.trainer.overlap import (HOST_SHARE, copy_fits, host_memory_available,
                                         overlap_copy_fits, served_bytes)

CONF = Path(__file__).resolve().parents[3] / "conf"
register_configs()


def config(model_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_train_config(compose("train", overrides=[
            "run_dir=/tmp/relax-test-run", "experiment=tiny_cpu", f"model.path={model_dir}",
            "algo.max_staleness=1", *overrides]))


def test_the_served_bytes_come_from_the_files_headers(tiny_model_dir):
    tensors = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    numel = sum(t.numel() for t in tensors.values())
    assert served_bytes(str(tiny_model_dir), torch.float32) == 4 * numel
    assert served_bytes(str(tiny_model_dir), torch.bfloat16) == 2 * numel


def test_the_served_bytes_of_bin_files_too(tiny_model_dir, tmp_path):
    # a checkpoint of pytorch_model*.bin files (no safetensors): counted from the mapped files
    tensors = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    names = sorted(tensors)
    torch.save({k: tensors[k] for k in names[:3]}, tmp_path / "pytorch_model-00001.bin")
    torch.save({k: tensors[k] for k in names[3:]}, tmp_path / "pytorch_model-00002.bin")
    numel = sum(t.numel() for t in tensors.values())
    assert served_bytes(str(tmp_path), torch.bfloat16) == 2 * numel


def test_a_copy_fits_in_its_share_of_the_available_memory():
    assert copy_fits(50, 100) and not copy_fits(51, 100) and HOST_SHARE == 0.5
    assert copy_fits(10**15, None)  # unknown: the copy is kept, as before
    assert host_memory_available() > 0  # Linux's MemAvailable


@pytest.mark.parametrize("overrides, gathered", [
    ((), False),  # DDP: the push sends the model's own tensors, no copy
    (("trainer.strategy=fsdp2",), True),
    (("trainer=megatron",), True),
    (("trainer.strategy=fsdp2", "model.lora.rank=8"), False),  # the adapter alone
])
def test_only_a_gathered_export_that_does_not_fit_falls_back_to_the_streamed_push(
        tiny_model_dir, caplog, overrides, gathered):
    cfg = config(tiny_model_dir, *overrides)
    need = served_bytes(str(tiny_model_dir), torch.float32)
    assert overlap_copy_fits(cfg, lambda: 2 * need)
    assert overlap_copy_fits(cfg, lambda: 2 * need - 1) is not gathered
    if gathered:
        assert "weight_sync.overlap=false" in caplog.text and "streamed" in caplog.text
