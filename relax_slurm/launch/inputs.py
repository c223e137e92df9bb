"""What every launcher checks and says before and between attempts, whatever it runs on: the
run's inputs exist (`check_inputs`, before anything starts or is queued), its one-line notices
(`say`), and a global restart recorded in RUN_DIR/restarts.jsonl (`record_global_restart`).

Used by the local runner (launch/local.py), the Slurm driver (launch/slurm_driver.py), the
sbatch submission (launch/sbatch.py) and `relax_slurm.submit` (launch/submit.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from relax_slurm import modeling, user_code
from relax_slurm.checkpoint import find_latest
from relax_slurm.config import TrainConfig
from relax_slurm.config.cross_checks import adapter_sync_blockers, check_data_parallel_batch
from relax_slurm.data.validate import check_data_files
from relax_slurm.engines import sglang_api
from relax_slurm.errors import ConfigError, RoleFailed
from relax_slurm.launch.hub_models import HUB_ID, resolve_model_paths
from relax_slurm.launch.records import record_restart
from relax_slurm.routing.shape import routing_shape


def check_inputs(cfg: TrainConfig) -> None:
    """The run's files exist and fit its config (before any role starts); model paths given as
    Hugging Face Hub ids become their cached snapshot's directory first (launch/hub_models.py)."""
    resolve_model_paths(cfg, say)
    model = Path(cfg.model.path)
    if not (model / "config.json").is_file():
        raise ConfigError(
            f"model.path={cfg.model.path}: no config.json there. Point model.path at a Hugging "
            "Face model directory, or build the tiny demo model with "
            "`python tools/make_tiny_model.py --out tiny/model`"
        )
    for key, files in (("data.train_files", cfg.data.train_files),
                       ("sft.val_files", cfg.sft.val_files if cfg.supervised else [])):
        for f in files:
            if not Path(f).exists():
                hub = (f" A Hub dataset id is not read from the Hub: `hf download {f} "
                       "--repo-type dataset --local-dir DIR`, then name its .parquet or .jsonl "
                       "files." if HUB_ID.fullmatch(f) else "")
                raise ConfigError(
                    f"{key}: {f} does not exist.{hub} For the demo data run "
                    "`python tools/prepare_data.py --out tiny`"
                )
    if not cfg.supervised:  # SFT splits sft.batch_size (trainer/sft.py)
        check_data_parallel_batch(cfg.trainer, cfg.rollout, cfg.cluster)
        check_user_code(cfg)
    check_trainer_takes(cfg)
    check_teacher(cfg)
    check_judge(cfg)
    check_sglang_serves(cfg)
    if not cfg.supervised:  # the reward's declared traits (rewards/registry.py) settle it
        from relax_slurm.rewards import reward_workers

        reward_workers(cfg.reward)
    if cfg.algo.routing_replay and routing_shape(cfg.model.path) is None:
        raise ConfigError(f"algo.routing_replay=true: model.path={cfg.model.path} is not a "
                          "mixture-of-experts model (its config.json names no experts); "
                          "unset it for a dense model")
    # proxy mode reads no prompts; SFT rows are checked as the trainer reads them
    if cfg.rollout.agent_mode == "env" and not cfg.supervised:
        check_data_files(cfg.data, cfg.eval.datasets if cfg.eval.every else [])
    say_lora_sync(cfg)


def check_user_code(cfg: TrainConfig) -> None:
    """reward.name and env.name naming the user's own code (relax_slurm/user_code.py): a
    relative file.py made absolute (kept in config.yaml), then found and parsed here, without
    running it, so a typo is refused before any role starts. In a container the roles import
    from the image, which the launcher cannot see: only the paths are made absolute there."""
    in_image = bool(getattr(cfg.cluster, "container", None) and
                    (cfg.cluster.container.image or cfg.cluster.container.prefix))
    for key, section, name in (("reward.name", cfg.reward, "name"), ("env.name", cfg.env, "name")):
        value = getattr(section, name)
        if not value or not user_code.is_user_code(value):
            continue
        setattr(section, name, user_code.absolute(value))
        if not in_image:
            user_code.locate(getattr(section, name), key)


def say_lora_sync(cfg: TrainConfig) -> None:
    """model.lora: once, what each weight sync sends (docs/lora.md)."""
    if not cfg.model.lora.enabled or cfg.supervised:
        return
    if cfg.adapter_sync:
        say(f"model.lora: each weight sync sends the rank-{cfg.model.lora.rank} adapter alone "
            f"(the engines serve each version's as '{sglang_api.ADAPTER_NAME}-v<version>' beside "
            "model.path)")
    else:
        say("model.lora: each weight sync sends merged weights (model.path + adapter), "
            f"because {'; '.join(adapter_sync_blockers(cfg.model, cfg.rollout))}")


def check_trainer_takes(cfg: TrainConfig) -> None:
    """trainer=torch runs the model's own forward; an Omni model's whole model has none (its
    thinker's is what trains): refused here, not as a TypeError in the first step. And
    model.lora under trainer=megatron on a multimodal model (not tested: the megatron backend
    refuses it when the model is built), here before anything starts, with the fix that
    applies (an Omni model has no other trainer)."""
    path, omni = cfg.model.path, modeling.has_thinker(cfg.model.path)
    if cfg.trainer.backend == "torch" and omni:
        raise ConfigError(
            f"model.path={path}: an Omni model (its config.json has a thinker_config) trains "
            "under trainer=megatron only: trainer=torch calls the whole model's forward, which "
            "Qwen2.5-Omni and Qwen3-Omni leave unimplemented (their thinker generates and "
            "trains). Fix: trainer=megatron (docs/backends.md#multimodal-models)")
    if cfg.trainer.backend == "megatron" and cfg.model.lora.enabled \
            and modeling.is_multimodal(path):
        fix = "model.lora.rank=0" if omni else "trainer=torch, or model.lora.rank=0"
        raise ConfigError(
            f"model.lora with trainer=megatron and a multimodal model (model.path={path}) is "
            f"not tested (docs/lora.md#status). Fix: {fix}")


def check_teacher(cfg: TrainConfig) -> None:
    teacher = cfg.algo.teacher_model_path
    if cfg.algo.name == "opd" and not teacher:
        raise ConfigError(
            "algo=opd needs a teacher: set algo.teacher_model_path=DIR (a Hugging Face model "
            "directory with the same tokenizer as model.path); relax-train serves it on one "
            "more hf engine (role `teacher`)"
        )
    if teacher and not (Path(teacher) / "config.json").is_file():
        raise ConfigError(f"algo.teacher_model_path={teacher}: no config.json there. Point it "
                          "at a Hugging Face model directory")


def check_judge(cfg: TrainConfig) -> None:
    judge = cfg.reward.genrm_model_path
    if judge and not (Path(judge) / "config.json").is_file():
        raise ConfigError(f"reward.genrm_model_path={judge}: no config.json there. Point it at a "
                          "Hugging Face model directory, or reward.genrm_url at a judge you run")


def check_sglang_serves(cfg: TrainConfig) -> None:
    """rollout.engine=sglang: every model it serves loads whole there and computes as the
    trainer does (sglang_api.why_unservable)."""
    if cfg.rollout.engine != "sglang":
        return
    for key, path in (("model.path", cfg.model.path),
                      ("algo.teacher_model_path", cfg.algo.teacher_model_path),
                      ("reward.genrm_model_path", cfg.reward.genrm_model_path)):
        config = Path(path or "") / "config.json"
        if not (path and config.is_file()):
            continue
        why = sglang_api.why_unservable(Path(path))
        if why:
            raise ConfigError(f"{key}={path}: {why}")


def record_global_restart(run_dir: Path, attempt: int, cap: int, cause: RoleFailed) -> None:
    resumes = find_latest(run_dir)
    row = {"attempt": attempt, "kind": "global", "cause": str(cause).splitlines()[0],
           "resumes_from": str(resumes) if resumes else None}
    record_restart(run_dir, row)
    # the launcher's own voice, like its errors (Hydra owns the logging config here)
    print(f"relax-train: global restart {attempt} of {cap} ({row['cause']}), from "
          f"{row['resumes_from'] or 'the start'}", file=sys.stderr, flush=True)


def say(text: str | None) -> None:
    if text:
        print(f"relax-train: {text}", file=sys.stderr, flush=True)


def gpu_visible() -> bool:
    """Whether this machine shows the launcher a CUDA GPU (torch's answer)."""
    import torch

    return torch.cuda.is_available()


def prepare_sglang_engines(cfg: TrainConfig) -> None:
    """rollout.engine=sglang on a local run: settle rollout.engine_device=auto (cpu without a
    GPU) and, for cpu engines with no rollout.engine_python, point it at the project's CPU
    SGLang venv, building it first when missing (minutes, once; relax-sglang-cpu install).
    The resolved keys go to RUN_DIR/config.yaml, so a restarted engine runs the same python."""
    r = cfg.rollout
    if r.engine != "sglang":
        return
    if r.engine_device == "auto":
        r.engine_device = "cuda" if gpu_visible() else "cpu"
    if r.engine_device == "cpu" and not r.engine_python:
        from relax_slurm.engines import sglang_cpu

        r.engine_python = str(sglang_cpu.ensure_venv(say=say))
    if not r.deterministic:
        say("rollout.deterministic=false: SGLang ignores every sampling_seed (its draws "
            "depend on how requests are batched), so a resumed run does not draw the tokens "
            "the uninterrupted run would; rollout.deterministic=true starts the engines with "
            "--enable-deterministic-inference")
