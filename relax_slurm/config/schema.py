"""Typed config schemas: one dataclass per Hydra group, one `TrainConfig` for the run.

YAML files under `conf/` fill these in; Hydra rejects unknown keys and wrong types because the
root is a structured config. Cross-field checks live in `__post_init__` and name the override
that fixes them; they run when `load_config` turns the merged config into these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from relax_slurm.errors import ConfigError


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(kw_only=True)
class ModelConfig:
    path: str = MISSING
    """A Hugging Face model directory (config.json, weights, tokenizer), read with from_pretrained."""
    dtype: str = "float32"
    """Parameter dtype for trainer and engines: float32, bfloat16 or float16."""
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        _check(self.dtype in ("float32", "bfloat16", "float16"),
               f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")


@dataclass(kw_only=True)
class AlgoConfig:
    name: str = "grpo"
    """Advantage estimator and loss family."""
    max_staleness: int = 0
    """How many policy versions a trained sample may lag behind; 0 is strictly on-policy."""
    std_normalize: bool = True
    """GRPO: divide group-centred rewards by the group std (false: Dr.GRPO mean-centring)."""
    eps_clip: float = 0.2
    """PPO clip range below 1."""
    eps_clip_high: Optional[float] = None
    """PPO clip range above 1; defaults to eps_clip (0.28 is DAPO's clip-higher)."""
    tis_clip: Optional[float] = 2.0
    """Truncated importance sampling cap on exp(train_logp - rollout_logp); null disables."""
    loss_reduction: str = "seq_mean_token_mean"
    """seq_mean_token_mean (per-sample token mean, then mean), token_sum or token_mean."""

    def __post_init__(self) -> None:
        _check(self.name == "grpo", f"algo.name={self.name!r}: this version supports algo=grpo")
        _check(self.max_staleness >= 0,
               f"algo.max_staleness={self.max_staleness}: must be >= 0 (0 = on-policy)")
        _check(self.eps_clip > 0, f"algo.eps_clip={self.eps_clip}: must be > 0")
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        _check(self.loss_reduction in ("seq_mean_token_mean", "token_sum", "token_mean"),
               f"algo.loss_reduction={self.loss_reduction!r}: use seq_mean_token_mean, "
               "token_sum or token_mean")
        _check(self.tis_clip is None or self.tis_clip > 0,
               f"algo.tis_clip={self.tis_clip}: must be > 0 or null")


@dataclass(kw_only=True)
class RolloutConfig:
    engine: str = "hf"
    """Engine backend: hf (transformers server of ours, CPU) or sglang (GPU)."""
    num_engines: int = 1
    """Engine servers to start; each joins the weight-sync group."""
    batch_size: int = 16
    """Prompt groups per training step (rollout_batch_size)."""
    n_samples_per_prompt: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_inflight_groups: int = 64
    """Groups the worker generates concurrently (bounded further by admission control)."""
    engine_max_batch_size: int = 1024
    """hf engine: sequences batched into one generate call."""
    engine_batch_wait_ms: float = 5.0
    """hf engine: how long to wait for more requests before starting a batch."""
    request_timeout_s: float = 300.0
    """Timeout of one /generate call."""
    startup_timeout_s: float = 300.0
    """How long to wait for an engine's /health after starting it."""
    torch_threads: int = 1
    """Intra-op threads of each engine process."""

    def __post_init__(self) -> None:
        _check(self.engine in ("hf", "sglang"),
               f"rollout.engine={self.engine!r}: use hf (CPU) or sglang (GPU)")
        _check(self.num_engines >= 1, f"rollout.num_engines={self.num_engines}: must be >= 1")
        _check(self.batch_size >= 1, f"rollout.batch_size={self.batch_size}: must be >= 1")
        _check(self.n_samples_per_prompt >= 2,
               f"rollout.n_samples_per_prompt={self.n_samples_per_prompt}: GRPO needs >= 2 "
               "samples per prompt to compare")
        _check(self.max_new_tokens >= 1, f"rollout.max_new_tokens={self.max_new_tokens}: >= 1")
        _check(self.temperature > 0,
               f"rollout.temperature={self.temperature}: must be > 0 for RL sampling")


@dataclass(kw_only=True)
class TrainerConfig:
    backend: str = "torch"
    """torch (transformers model, DDP/FSDP2, CPU or GPU) or megatron (GPU)."""
    strategy: str = "ddp"
    """torch backend data parallelism: ddp or fsdp2."""
    nproc_per_node: int = 2
    """torchrun ranks per node."""
    total_steps: int = 100
    """Optimizer steps to run."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    warmup_steps: int = 0
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    """Samples per forward/backward on one rank (gradient accumulation beyond it)."""
    seed: int = 0
    get_batch_timeout_s: float = 600.0
    """How long a step waits for its batch from the broker before failing."""
    torch_threads: int = 1
    """Intra-op threads per rank on CPU."""
    save_every: int = 0
    """Checkpoint every this many steps (0: only at the end of the run)."""
    keep_last: int = 2
    """Checkpoints kept in run_dir/checkpoints (older ones are deleted after a newer completes)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    save_hf_every: int = 0
    """Export a Hugging Face directory every this many steps (0: never), for evaluation."""

    def __post_init__(self) -> None:
        _check(self.save_every >= 0, f"trainer.save_every={self.save_every}: must be >= 0")
        _check(self.keep_last >= 1, f"trainer.keep_last={self.keep_last}: keep at least 1")
        _check(self.backend in ("torch", "megatron"),
               f"trainer.backend={self.backend!r}: use torch or megatron")
        _check(self.strategy in ("ddp", "fsdp2"),
               f"trainer.strategy={self.strategy!r}: use ddp or fsdp2")
        _check(self.nproc_per_node >= 1, f"trainer.nproc_per_node={self.nproc_per_node}: >= 1")
        _check(self.total_steps >= 1, f"trainer.total_steps={self.total_steps}: >= 1")
        _check(self.lr > 0, f"trainer.lr={self.lr}: must be > 0")
        _check(self.micro_batch_size >= 1, f"trainer.micro_batch_size: >= 1")


@dataclass(kw_only=True)
class DataConfig:
    train_files: list[str] = MISSING
    """jsonl / parquet files or a saved HF dataset folder."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    label_key: str = "label"
    """Column holding the reference answer given to the reward."""
    metadata_key: Optional[str] = None
    """Optional column passed through to the reward as metadata."""
    system_prompt: Optional[str] = None
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (false: raw text)."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after the template) are filtered out, with a count logged."""
    shuffle: bool = True
    seed: int = 0
    num_epochs: int = 1000
    """Passes over the data; the run also stops at trainer.total_steps."""

    def __post_init__(self) -> None:
        _check(self.train_files == MISSING or len(self.train_files) > 0,
               "data.train_files is empty: set data.train_files=[path/to/train.jsonl]")


@dataclass(kw_only=True)
class RewardConfig:
    name: str = "exact_match"
    """A registered reward (see relax_slurm.rewards) or a dotted path module:function."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    backend: str = "auto"
    """auto (nccl with GPUs, gloo without), gloo or nccl."""
    bucket_mb: int = 512
    """Tensors are announced to engines in buckets of about this size."""
    timeout_s: float = 300.0
    verify: bool = False
    """After every sync, compare engine and trainer weight checksums (tests, debugging)."""

    def __post_init__(self) -> None:
        _check(self.backend in ("auto", "gloo", "nccl"),
               f"weight_sync.backend={self.backend!r}: use auto, gloo or nccl")


@dataclass(kw_only=True)
class BrokerConfig:
    request_timeout_s: float = 60.0
    """Timeout of one request/reply with the broker."""
    host: str = "127.0.0.1"
    """Interface the broker binds (local runs); on Slurm the node's address."""


@dataclass(kw_only=True)
class ClusterConfig:
    kind: str = "local"
    """local (subprocesses on this machine) or slurm."""
    step_timeout_s: float = 900.0
    """A run with no new step for this long is failed as hung."""
    trainer_cpus: Optional[list[int]] = None
    """Pin trainer ranks to these CPU ids (local runs); null leaves it to the OS."""
    rollout_cpus: Optional[list[int]] = None
    """Pin engines and rollout workers to these CPU ids (local runs)."""

    def __post_init__(self) -> None:
        _check(self.kind in ("local", "slurm"), f"cluster.kind={self.kind!r}: use local or slurm")


@dataclass(kw_only=True)
class MetricsConfig:
    progress: bool = True
    """Progress bar on a terminal, plain lines otherwise."""
    log_every: int = 1


@dataclass(kw_only=True)
class TrainConfig:
    run_dir: str = MISSING
    """Directory of this run: config.yaml, metrics.jsonl, logs/, checkpoints/."""
    seed: int = 0
    resume: str = "auto"
    """auto: resume from the latest complete checkpoint in run_dir if any; none: start fresh
    (refused if run_dir has checkpoints, unless overwrite=true); or a checkpoint path."""
    overwrite: bool = False
    """With resume=none, allow starting over in a run_dir that has checkpoints."""
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
