"""model.path as a Hugging Face Hub id (the GPU presets ship `Qwen/Qwen3-4B`): the launcher's
input check takes the model's snapshot from this machine's Hugging Face cache (huggingface_hub's
own lookup, offline) and the run reads that directory; an id that is not cached is refused
naming the key and the download (it used to say "no config.json there", as for a mistyped
directory). In a process of its own, whose HF_HUB_CACHE is a cache laid out as `hf download`
leaves it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from tests.conftest import run_env

CHECK = """
import json, sys
from relax_slurm.errors import ConfigError
from relax_slurm.launch.compose import compose_config
from relax_slurm.launch.inputs import check_inputs
cfg = compose_config(sys.argv[1:])
try:
    check_inputs(cfg)
except ConfigError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({"path": cfg.model.path}))
"""


def check(tmp_path, cache, *overrides: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", CHECK, "experiment=tiny_cpu",
                          f"run_dir={tmp_path / 'run'}",
                          f"data.train_files=[{tmp_path / 'tiny' / 'arith_train.jsonl'}]",
                          *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=run_env() | {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_cached_hub_id_is_read_from_its_snapshot_and_an_uncached_one_names_the_download(
        tmp_path, tiny_assets):
    shutil.copytree(tiny_assets, tmp_path / "tiny")
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-qwen3" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_assets / "model", snapshot)
    (cache / "models--tiny-org--tiny-qwen3" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-qwen3" / "refs" / "main").write_text("0123abcd")

    found, said = check(tmp_path, cache, "model.path=tiny-org/tiny-qwen3")
    assert found == {"path": str(snapshot)}, found
    assert f"model.path=tiny-org/tiny-qwen3: the Hugging Face cache's snapshot {snapshot}" in said

    missing, _ = check(tmp_path, cache, "model.path=tiny-org/not-downloaded")
    assert "model.path=tiny-org/not-downloaded: no such directory here" in missing["error"]
    assert "hf download tiny-org/not-downloaded --local-dir" in missing["error"], missing
    assert str(cache) in missing["error"], missing

    # a directory that exists is a path, whatever its shape: tiny/model here
    local, said = check(tmp_path, cache, "model.path=tiny/model")
    assert local == {"path": "tiny/model"} and "snapshot" not in said


def test_a_hub_dataset_id_in_the_train_files_says_how_to_get_its_files(tmp_path, tiny_assets):
    shutil.copytree(tiny_assets, tmp_path / "tiny")
    found, _ = check(tmp_path, tmp_path / "hub", "model.path=tiny/model",
                     "data.train_files=[openai/gsm8k]")
    assert found["error"].startswith("data.train_files: openai/gsm8k does not exist."), found
    assert "hf download openai/gsm8k --repo-type dataset --local-dir DIR" in found["error"]
