"""GPU presets under `cluster.dry_run=true`: golden sbatch scripts with their srun, torchrun and
sglang.launch_server command lines, and the GPU placement each preset promises.

Regenerate after an intended change with
    RELAX_UPDATE_GOLDEN=1 python -m pytest tests/unit/launch/test_gpu_presets.py
then read the diff.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from relax_slurm.launch import sbatch
from relax_slurm.launch.submit import compose_config
from tests.unit.launch.test_sbatch import check_golden

RUN_DIR, WORKDIR = Path("/scratch/runs/demo"), Path("/home/me/project")
PRESETS = ["qwen3_4b_dapo", "qwen3_30b_a3b_dapo", "qwen3_vl_4b_openr1",
           "qwen3_vl_30b_a3b_openr1", "qwen3_omni_30b_a3b_avqa"]


def dry_run(preset: str, *overrides: str) -> str:
    cfg = compose_config([f"experiment={preset}", f"run_dir={RUN_DIR}",
                          "cluster.python=/opt/venv/bin/python", *overrides])
    text = sbatch.dry_run_text(cfg, RUN_DIR, WORKDIR)
    # ports are picked free in the allocation and the interpreter is this one's: normalise
    text = text.replace(sys.executable, "PYTHON")
    text = re.sub(r"(?<=:)\d{4,5}\b", "PORT", text)
    return re.sub(r"--(nccl-)?port \d+", r"--\1port PORT", text)


def sruns(text: str, expand: bool = True) -> dict[str, list[str]]:
    """srun argv per role; `expand` unwraps `bash -c 'exec CMD --api-key "$KEY"'` into CMD's
    argv (sglang engines always have an API key)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("srun "):
            argv = shlex.split(line)
            if expand and argv[-3:-1] == ["bash", "-c"]:
                argv = argv[:-3] + shlex.split(argv[-1].removeprefix("exec "))
            out[next(a for a in argv if a.startswith("--job-name=")).split("=")[1]] = argv
    return out


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("preset", PRESETS)
def test_dry_run_matches_golden(preset):
    text = dry_run(preset)
    check_golden(f"{preset}.dryrun", text)
    script = text.split("\n# The driver then starts")[0]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_qwen3_4b_separate_pools_on_one_node():
    lines = sruns(dry_run("qwen3_4b_dapo"))
    engines = [lines[f"engine{i}"] for i in range(4)]
    assert [flag(e, "--base-gpu-id") for e in engines] == ["4", "5", "6", "7"]
    assert all("sglang.launch_server" in e and flag(e, "--tp-size") == "1" for e in engines)
    assert all("--nodelist=trainer-node1" in e and "--het-group=1" not in e for e in engines)
    assert "--nproc-per-node=4" in lines["trainer"]
    assert "--enable-memory-saver" not in engines[0]


def test_deterministic_rollouts_start_sglang_deterministic():
    plain = sruns(dry_run("qwen3_4b_dapo"))["engine0"]
    det = sruns(dry_run("qwen3_4b_dapo", "rollout.deterministic=true"))["engine0"]
    assert "--enable-deterministic-inference" not in plain
    assert "--enable-deterministic-inference" in det


def test_qwen3_4b_shared_gpus_release_memory():
    lines = sruns(dry_run("qwen3_4b_dapo", "trainer.nproc_per_node=8", "rollout.num_engines=2",
                          "rollout.engine_tp_size=4", "rollout.release_memory_during_train=true",
                          "rollout.engine_mem_fraction=0.5", "algo.max_staleness=0"))
    assert [flag(lines[f"engine{i}"], "--base-gpu-id") for i in range(2)] == ["0", "4"]
    assert all("--enable-memory-saver" in lines[f"engine{i}"] for i in range(2))


def test_qwen3_30b_a3b_engines_use_expert_parallelism():
    text = dry_run("qwen3_30b_a3b_dapo")
    lines = sruns(text)
    assert "#SBATCH hetjob" in text
    for i, node in enumerate(["rollout-node1", "rollout-node2"]):
        e = lines[f"engine{i}"]
        assert flag(e, "--tp-size") == "8" and flag(e, "--ep-size") == "8"
        assert flag(e, "--base-gpu-id") == "0" and f"--nodelist={node}" in e
        assert "--het-group=1" in e and flag(e, "--dtype") == "bfloat16"
    assert "--nnodes=2" in lines["trainer"] and "--nproc-per-node=8" in lines["trainer"]


def test_api_key_never_printed():
    text = dry_run("qwen3_vl_4b_openr1")  # rollout.engine_api_key is on by default
    e = sruns(text, expand=False)["engine0"]
    assert e[-3:-1] == ["bash", "-c"] and e[-1].endswith('--api-key "$RELAX_ENGINE_API_KEY"')


def test_shared_gpus_need_the_on_policy_schedule():
    from relax_slurm.errors import ConfigError

    with pytest.raises(ConfigError, match="release_memory_during_train.*max_staleness=0"):
        compose_config(["experiment=qwen3_4b_dapo", f"run_dir={RUN_DIR}",
                        "rollout.release_memory_during_train=true", "algo.max_staleness=1"])


def test_presets_parallel_sizes():
    """The Qwen3 and Qwen3-VL presets train with megatron-core (Omni stays on FSDP2: no bridge)."""
    def sizes(preset):
        t = compose_config([f"experiment={preset}", f"run_dir={RUN_DIR}"]).trainer
        return (t.backend, t.tensor_parallel_size, t.pipeline_parallel_size,
                t.expert_parallel_size, t.nproc_per_node)

    assert sizes("qwen3_4b_dapo") == ("megatron", 2, 1, 1, 4)  # DP=2 on GPUs 0-3
    assert sizes("qwen3_30b_a3b_dapo") == ("megatron", 2, 1, 8, 8)  # 16 GPUs: DP=8, EP=8
    assert sizes("qwen3_vl_4b_openr1") == ("megatron", 2, 1, 1, 8)  # DP=4
    assert sizes("qwen3_vl_30b_a3b_openr1") == ("megatron", 2, 1, 8, 8)  # 16 GPUs: DP=8, EP=8
    assert compose_config(["experiment=qwen3_30b_a3b_dapo", f"run_dir={RUN_DIR}"]
                          ).trainer.use_distributed_optimizer


def test_multimodal_presets_compose_with_their_media():
    vl = compose_config(["experiment=qwen3_vl_4b_openr1", f"run_dir={RUN_DIR}"])
    assert dict(vl.data.multimodal_keys) == {"image": "image"} and vl.reward.name == "openr1mm"
    omni = compose_config(["experiment=qwen3_omni_30b_a3b_avqa", f"run_dir={RUN_DIR}"])
    assert dict(omni.data.multimodal_keys) == {"audio": "audios"}
    assert omni.reward.name == "multiple_choice"
    lines = sruns(dry_run("qwen3_omni_30b_a3b_avqa"))
    assert flag(lines["engine0"], "--ep-size") == "8" and flag(lines["engine0"], "--tp-size") == "8"


def test_context_parallel_override_renders():
    """trainer.context_parallel_size=2 on the 4B preset: TP=2 x CP=2 on the trainer's 4 GPUs
    (DP=1). Validated at composition (CP needs CUDA and transformer-engine, which the trainer
    checks when it starts on its node, not the login node), and rendered: CP changes no command
    line (the trainer reads it from config.yaml), so the text is the preset's golden."""
    cfg = compose_config(["experiment=qwen3_4b_dapo", f"run_dir={RUN_DIR}",
                          "trainer.context_parallel_size=2"])
    t = cfg.trainer
    assert (t.tensor_parallel_size, t.context_parallel_size, t.nproc_per_node) == (2, 2, 4)
    text = dry_run("qwen3_4b_dapo", "trainer.context_parallel_size=2")
    check_golden("qwen3_4b_dapo.dryrun", text)
    from relax_slurm.errors import ConfigError

    with pytest.raises(ConfigError, match="context_parallel_size=4"):  # 2 x 4 does not fit 4
        compose_config(["experiment=qwen3_4b_dapo", f"run_dir={RUN_DIR}",
                        "trainer.context_parallel_size=4"])
