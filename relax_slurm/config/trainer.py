"""`trainer`: the backend, its parallelism, optimizer, lr schedule and checkpoint cadence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from relax_slurm.config.check import check

SCHEDULES = ("constant", "cosine", "linear")
"""trainer.lr_schedule's choices (relax_slurm.trainer.schedule computes them)."""
RECOMPUTE = ("none", "full", "selective")
"""trainer.recompute's choices (trainer/model.py, trainer/megatron/model.py apply them)."""


@dataclass(kw_only=True)
class StopAtConfig:
    """`trainer.stop_at`: end the run before trainer.total_steps once it has learned enough
    (trainer/stop_at.py). The trainer then does what `relax-ctl stop` asks: a final checkpoint,
    exit 0, summary.json's `stopped_early` giving the step and the reason."""

    reward: Optional[float] = None
    """Stop after the first step at which the mean of rollout/reward_mean over the last
    `steps` steps is at least this; null: run to trainer.total_steps."""
    steps: int = 3
    """How many steps' rewards that mean takes (summary.json's reward_last takes 3). Counted
    from the run's (or the resumed attempt's) first step."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, f"trainer.stop_at.steps={self.steps}: must be >= 1")


@dataclass(kw_only=True)
class TrainerConfig:
    backend: str = "torch"
    """torch (transformers model, DDP/FSDP2) or megatron (megatron-core through megatron-bridge,
    TP/PP/EP; on CPU through trainer/megatron/cpu_compat.py). See docs/backends.md."""
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
    """Linear lr warm-up over this many steps."""
    lr_schedule: str = "constant"
    """After warm-up: constant, cosine or linear decay to min_lr_ratio x lr at total_steps."""
    min_lr_ratio: float = 0.0
    """The decayed lr at the end of the decay, as a fraction of lr (cosine and linear)."""
    lr_decay_steps: Optional[int] = None
    """Steps over which the lr decays (Megatron's lr_decay_iters); null: total_steps. Fixing
    it makes a shorter run follow the first steps of the full run's schedule."""
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    """Samples per forward/backward on one rank (gradient accumulation beyond it)."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout batch (Relax's num_steps_per_rollout): the batch is cut into
    this many equal mini-batches, one step each, the PPO ratio measured against the policy
    before the first step. The policy version and the lr schedule still advance once per batch
    (trainer.total_steps counts batches). torch backend, whole batches only."""
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
    """Export a Hugging Face directory every this many steps (0: never), for evaluation; when
    set, a run that stops early (relax-ctl stop, trainer.stop_at) exports its last step too."""
    tensor_parallel_size: int = 1
    """megatron backend: ranks a layer's matrices are split over (divides the attention heads)."""
    pipeline_parallel_size: int = 1
    """megatron backend: pipeline stages the layers are split into (divides the layers)."""
    context_parallel_size: int = 1
    """megatron backend: ranks a sequence is split over; > 1 needs CUDA and transformer-engine
    (checked when the trainer starts, see trainer/megatron/context_parallel.py)."""
    expert_parallel_size: int = 1
    """megatron backend: ranks the MoE experts are spread over (divides the experts)."""
    use_distributed_optimizer: bool = False
    """megatron backend: shard the optimizer state and fp32 main weights over data-parallel
    ranks (ZeRO-1; gradients reduce-scattered, weights all-gathered after each step)."""
    recompute: str = "none"
    """Activation recomputation: trade compute for memory in the backward. none: every layer's
    activations kept from the forward; full: only each transformer layer's input is kept and
    its forward runs again in the backward (~1/3 more compute; both backends: transformers'
    gradient checkpointing, megatron-core's recompute_granularity=full, one layer per
    checkpoint); selective (megatron only): core attention alone is recomputed, which keeps
    most of the memory saving of long sequences at a few percent of compute."""
    logprob_chunk_size: int = 0
    """Positions per chunk of the log-prob and entropy computation from the logits (0: the
    whole sequence at once). The float32 copy of the logits, their softmax and what the
    backward keeps of them exist for one chunk at a time (each chunk recomputed in the
    backward): for an 8,192-token row of a 151,936-token vocabulary ~5 GB per float32
    [T, V] tensor become ~0.6 GB at 1024. The model's own logits (in its dtype, each TP rank's
    vocabulary slice under megatron) remain. Values and gradients are those of the whole
    sequence (tests/unit/trainer/test_logprob_chunks.py)."""
    towers: str = "replicated"
    """megatron backend, multimodal models at TP > 1: how the vision and audio towers (whole on
    every TP rank) share a micro-batch's media. replicated: every TP rank encodes every image,
    video and audio (TP times the towers' compute); split: each TP rank encodes a contiguous
    share of them, of about equal patches or mel frames, and the features are all-gathered
    over TP (the gradients are those of replicated towers; trainer/megatron/tower_split.py).
    docs/backends.md#multimodal-models has the measured step times."""
    freeze_modules: list[str] = field(default_factory=list)
    """Parameter name prefixes not trained (still synced to engines), e.g. [model.visual] for
    a Qwen-VL vision tower or [model.audio_tower] for Qwen2-Audio's encoder."""
    stop_at: StopAtConfig = field(default_factory=StopAtConfig)
    """End the run early at a reward target (trainer.stop_at.reward); off by default."""
    streaming: Optional[bool] = None
    """Start forward/backward on complete groups as they arrive instead of waiting for the whole
    batch; the optimizer steps once all of the step's groups are in (same update as the whole
    batch). null: wherever it applies (algo.max_staleness >= 1, trainer=torch, a per-group
    estimator, a loss_reduction whose weights need no batch-wide token count); true: refused
    where it does not apply, with the reason; false: whole batches. See docs/algorithms.md."""

    def __post_init__(self) -> None:
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                    "expert_parallel_size"):
            check(getattr(self, key) >= 1, f"trainer.{key}={getattr(self, key)}: must be >= 1")
        parallel = (self.tensor_parallel_size, self.pipeline_parallel_size,
                    self.context_parallel_size, self.expert_parallel_size)
        check(self.backend == "megatron" or parallel == (1, 1, 1, 1),
               f"trainer.backend={self.backend}: tensor/pipeline/context/expert parallel sizes "
               "need trainer=megatron (the torch backend is data parallel only); set them to 1")
        check(self.backend == "megatron" or not self.use_distributed_optimizer,
               f"trainer.backend={self.backend}: trainer.use_distributed_optimizer is the megatron "
               "backend's; with trainer=torch shard the optimizer with trainer.strategy=fsdp2, and "
               "set trainer.use_distributed_optimizer=false")
        check(self.logprob_chunk_size >= 0,
               f"trainer.logprob_chunk_size={self.logprob_chunk_size}: positions per chunk, >= 1, "
               "or 0 for the whole sequence at once")
        check(self.towers in ("replicated", "split"),
              f"trainer.towers={self.towers!r}: use replicated or split")
        check(self.towers == "replicated" or self.backend == "megatron",
              f"trainer.towers=split shares the media over megatron's tensor-parallel ranks; "
              f"trainer.backend={self.backend} has none: set trainer.towers=replicated")
        check(self.recompute in RECOMPUTE,
               f"trainer.recompute={self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        check(self.recompute != "selective" or self.backend == "megatron",
               "trainer.recompute=selective recomputes megatron-core's core attention; "
               f"trainer.backend={self.backend} has no such split: use trainer.recompute=full "
               "(transformers' gradient checkpointing) or trainer=megatron")
        check(self.save_every >= 0, f"trainer.save_every={self.save_every}: must be >= 0")
        check(self.keep_last >= 1, f"trainer.keep_last={self.keep_last}: keep at least 1")
        check(self.backend in ("torch", "megatron"),
               f"trainer.backend={self.backend!r}: use torch or megatron")
        check(self.strategy in ("ddp", "fsdp2"),
               f"trainer.strategy={self.strategy!r}: use ddp or fsdp2")
        check(self.nproc_per_node >= 1, f"trainer.nproc_per_node={self.nproc_per_node}: >= 1")
        check(self.total_steps >= 1, f"trainer.total_steps={self.total_steps}: >= 1")
        check(self.lr > 0, f"trainer.lr={self.lr}: must be > 0")
        check(self.warmup_steps >= 0, f"trainer.warmup_steps={self.warmup_steps}: >= 0")
        check(self.lr_schedule in SCHEDULES,
               f"trainer.lr_schedule={self.lr_schedule!r}: use one of {', '.join(SCHEDULES)}")
        check(self.lr_decay_steps is None or self.lr_decay_steps >= 1,
               f"trainer.lr_decay_steps={self.lr_decay_steps}: >= 1, or null for total_steps")
        check(0.0 <= self.min_lr_ratio <= 1.0,
               f"trainer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        check(self.micro_batch_size >= 1,
               f"trainer.micro_batch_size={self.micro_batch_size}: must be >= 1")
        check(self.num_steps_per_rollout >= 1,
               f"trainer.num_steps_per_rollout={self.num_steps_per_rollout}: must be >= 1")
