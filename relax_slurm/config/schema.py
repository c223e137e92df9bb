"""Typed config schemas: one dataclass per Hydra group, one `TrainConfig` for the run.

YAML files under `conf/` fill these in; Hydra rejects unknown keys and wrong types because the
root is a structured config. Cross-field checks live in `__post_init__` and name the override
that fixes them; they run when `load_config` turns the merged config into these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from relax_slurm.errors import ConfigError


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def default_of(cls: type, name: str) -> Any:
    """A config field's default: the one place it is written (the media processor's limits
    and the hf engine's flags of the same name read theirs from here)."""
    return cls.__dataclass_fields__[name].default


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


# Names registered in relax_slurm.algos (checked against its registry by a unit test), kept here
# so that validating a config does not import torch.
SEED_LIMIT = 1 << 22
"""seed below this: its sampling seeds (seed << 40, plus up to 2**40 samples) stay in int64."""
SCHEDULES = ("constant", "cosine", "linear")
"""trainer.lr_schedule's choices (relax_slurm.trainer.schedule computes them)."""
FLATTENED_BUCKET = "flattened_bucket"  # weight_sync.load_format: one broadcast per bucket
ALGO_NAMES = ("cispo", "dapo", "grpo", "gspo", "opd", "ppo", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline", "rloo", "sapo")
PPO_CLIP_ALGOS = frozenset(ALGO_NAMES) - {"cispo", "sapo"}
"""The estimators whose loss is PPO's clipped objective (where dual-clip has a place)."""
NO_REWARD_KL_ALGOS = frozenset({"rloo", "reinforce_plus_plus_baseline"})
"""The estimators with no place for a reward-side KL (Relax's forbids_reward_side_kl)."""
BATCH_WIDE_ADVANTAGE_ALGOS = frozenset({"reinforce_plus_plus", "reinforce_plus_plus_baseline"})
"""The estimators whose advantages use the whole batch's rewards, not each group's alone (a
streaming trainer computes advantages group by group as they arrive; see trainer/stream.py)."""
CRITIC_ALGOS = frozenset({"ppo"})
"""The estimators whose advantages come from a value model the trainer trains (GAE)."""
SUPERVISED_ALGOS = ("sft",)
"""Algorithms that learn from a dataset's targets, not from rollouts: the launcher starts the
trainer alone (no broker, engines or rollout worker) and it runs trainer/sft.py's loop."""
ALGO_NAMES += SUPERVISED_ALGOS  # after PPO_CLIP_ALGOS: SFT has no clipped objective


@dataclass(kw_only=True)
class AlgoConfig:
    name: str = "grpo"
    """Advantage estimator and loss family (see docs/algorithms.md)."""
    max_staleness: int = 0
    """How many policy versions a trained sample may lag behind; 0 is strictly on-policy."""
    std_normalize: bool = True
    """GRPO: divide group-centred rewards by the group std (false: Dr.GRPO mean-centring)."""
    eps_clip: float = 0.2
    """PPO clip range below 1."""
    eps_clip_high: Optional[float] = None
    """PPO clip range above 1; defaults to eps_clip (0.28 is DAPO's clip-higher). CISPO: the
    bounds of its importance weight, [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_c: Optional[float] = None
    """Dual-clip (> 1, e.g. 3): for negative advantages the PPO loss is capped at
    eps_clip_c x |A| (Relax's eps_clip_c); null: off. PPO-clip estimators only."""
    old_logprobs: str = "auto"
    """The PPO ratio's denominator. recompute: the trainer's policy before this step (one
    optimizer step per batch, so the ratio is 1 and the clip only shapes the gradient; stale
    samples are corrected by TIS). rollout: the engine's log-probs, so the clip also bounds how
    far an update moves from the policy that sampled (classic PPO on off-policy data; the TIS
    weight is then 1). auto: rollout when max_staleness > 0, else recompute."""
    tis_clip: Optional[float] = 2.0
    """Truncated importance sampling cap on exp(train_logp - rollout_logp); null disables."""
    tis_type: str = "truncate"
    """truncate (weights capped at tis_clip) or icepop (weights outside [tis_clip_low, tis_clip]
    set to 0)."""
    tis_clip_low: Optional[float] = None
    """icepop: lower end of the kept band; null means 1 / tis_clip."""
    loss_reduction: str = "seq_mean_token_mean"
    """seq_mean_token_mean (per-sample token mean, then mean), token_sum or token_mean."""
    entropy_coef: float = 0.0
    """Entropy bonus: entropy_coef * per-token entropy is subtracted from the loss; 0 disables."""
    kl_loss_coef: float = 0.0
    """Weight of the KL-to-reference-model loss term; 0 disables (no reference model needed)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss: k1, k2, k3 or low_var_kl (k3 clamped to +-10)."""
    kl_coef: float = 0.0
    """Reward-side KL (Relax's kl_coef): each token's advantage is lowered by kl_coef x the KL
    (kl_loss_type, of the sampling-time policy to the reference) summed from that token to the
    end of its response (algo=ppo: -kl_coef x KL in the token rewards, before GAE); 0 disables.
    Not for rloo and reinforce_plus_plus_baseline (refused)."""
    ref_update_interval: Optional[int] = None
    """Replace the frozen reference model by the current policy every this many rollout batches
    (after the batch's update; Relax's ref_update_interval); null: the reference stays
    model.path. The reference is then checkpointed, so a resume restores it exactly."""
    opsm_delta: Optional[float] = None
    """Off-policy sequence masking: drop sequences with A < 0 and mean KL(rollout || policy)
    above this many nats; null disables."""
    tau_pos: float = 1.0
    """SAPO: gate temperature for tokens with positive advantage."""
    tau_neg: float = 1.05
    """SAPO: gate temperature for tokens with negative (or zero) advantage."""
    opd_kl_coef: float = 1.0
    """OPD: weight of (logp_student - logp_teacher) subtracted from each token's advantage."""
    opd_only_reward: bool = False
    """OPD: drop the task reward's advantage and learn from the teacher term alone."""
    teacher_model_path: Optional[str] = None
    """On-policy distillation on any estimator: Hugging Face directory of the teacher (same
    tokenizer as model.path). The launcher serves it on one more engine (role `teacher`;
    locally and as a step of the Slurm rollout component)
    whose prefill log-probs of every model token go into the samples, and the teacher term
    (opd_kl_coef) joins whatever algo.name computes; required by algo=opd (GRPO + teacher)."""
    routing_replay: bool = False
    """Rollout routing replay (R3), MoE models: the trainer's MoE layers route every token to
    the experts the rollout engine chose for it (gating weights still from the trainer's own
    router, so it learns), removing the router disagreement from the train/rollout log-prob
    gap. Needs rollout.return_routed_experts (docs/algorithms.md#routing-replay)."""
    dynamic_sampling: bool = False
    """Data filter: drop groups whose rewards are all equal and sample more prompts to refill
    the batch (DAPO)."""
    overlong_buffer_tokens: int = 0
    """Data filter: soft overlong penalty over the last this-many tokens before
    rollout.max_new_tokens (DAPO); 0 disables."""
    overlong_penalty_factor: float = 1.0
    """Penalty added to the reward of a response reaching rollout.max_new_tokens (scaled down
    linearly inside the buffer)."""
    gamma: float = 1.0
    """algo=ppo: discount of GAE per response token (1: the score counts fully at every token)."""
    lam: float = 1.0
    """algo=ppo: GAE's lambda (1: advantage = return - value; lower trusts the critic more)."""
    value_clip: Optional[float] = 0.2
    """algo=ppo: the value loss's clip range around the critic's values before the step
    (verl's cliprange_value); null: the plain 0.5 x (V - R)^2."""
    critic_lr: Optional[float] = None
    """algo=ppo: the critic's AdamW learning rate, constant; null: 5 x trainer.lr (betas, weight
    decay and gradient clip are trainer.adam_beta1/2, weight_decay, grad_clip)."""
    critic_warmup_steps: int = 0
    """algo=ppo: the first this-many rollout batches train the critic alone (the policy's weights
    and optimizer state stay; its lr schedule still counts them; verl's critic_warmup)."""

    def __post_init__(self) -> None:
        _check(self.name in ALGO_NAMES,
               f"algo.name={self.name!r}: choose one of {', '.join(ALGO_NAMES)} (algo=<name>)")
        _check(self.max_staleness >= 0,
               f"algo.max_staleness={self.max_staleness}: must be >= 0 (0 = on-policy)")
        _check(self.eps_clip > 0, f"algo.eps_clip={self.eps_clip}: must be > 0")
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        _check(self.eps_clip_high > 0, f"algo.eps_clip_high={self.eps_clip_high}: must be > 0")
        if self.eps_clip_c is not None:
            _check(self.eps_clip_c > 1,
                   f"algo.eps_clip_c={self.eps_clip_c}: must be > 1 (the cap is eps_clip_c x |A|, "
                   "above the clipped objective's 1 - eps_clip), or null")
            _check(self.name in PPO_CLIP_ALGOS,
                   f"algo.eps_clip_c (dual-clip) caps PPO's clipped objective, which "
                   f"algo={self.name} does not have (cispo weights by a clipped ratio, sapo "
                   "gates softly): unset it")
        _check(self.loss_reduction in ("seq_mean_token_mean", "token_sum", "token_mean"),
               f"algo.loss_reduction={self.loss_reduction!r}: use seq_mean_token_mean, "
               "token_sum or token_mean")
        _check(self.old_logprobs in ("auto", "recompute", "rollout"),
               f"algo.old_logprobs={self.old_logprobs!r}: use auto, recompute or rollout")
        if self.old_logprobs == "auto":
            # measured on the tiny run at max_staleness=2: recompute+TIS peaked near 0.3 and fell
            # back, rollout reached 0.84 by step 100
            self.old_logprobs = "rollout" if self.max_staleness > 0 else "recompute"
        _check(self.tis_clip is None or self.tis_clip > 0,
               f"algo.tis_clip={self.tis_clip}: must be > 0 or null")
        self._check_terms()

    @property
    def uses_reference(self) -> bool:
        """Whether the trainer loads a frozen reference model (a KL to it is in the loss)."""
        return self.kl_loss_coef > 0 or self.kl_coef > 0

    def _check_terms(self) -> None:
        _check(self.tis_type in ("truncate", "icepop"),
               f"algo.tis_type={self.tis_type!r}: use truncate or icepop")
        if self.tis_type == "icepop":
            _check(self.tis_clip is not None,
                   "algo.tis_type=icepop needs a band: set algo.tis_clip (e.g. 5.0)")
            low = self.tis_clip_low if self.tis_clip_low is not None else 1.0 / self.tis_clip
            _check(0 <= low < self.tis_clip,
                   f"algo.tis_clip_low={self.tis_clip_low}: must be >= 0 and below "
                   f"algo.tis_clip={self.tis_clip}")
        _check(self.entropy_coef >= 0, f"algo.entropy_coef={self.entropy_coef}: must be >= 0")
        _check(self.kl_loss_coef >= 0, f"algo.kl_loss_coef={self.kl_loss_coef}: must be >= 0")
        _check(self.kl_loss_type in ("k1", "k2", "k3", "low_var_kl"),
               f"algo.kl_loss_type={self.kl_loss_type!r}: use k1, k2, k3 or low_var_kl")
        _check(self.kl_coef >= 0, f"algo.kl_coef={self.kl_coef}: must be >= 0")
        _check(not self.kl_coef or self.name not in NO_REWARD_KL_ALGOS,
               f"algo.kl_coef={self.kl_coef}: algo={self.name} has no place for a reward-side KL "
               "(its advantage is built from the completion-level reward alone: a leave-one-out "
               "baseline for rloo, a group baseline whitened over the batch for "
               "reinforce_plus_plus_baseline, as in Relax's spec); set algo.kl_coef=0 and use "
               "the KL loss (algo.kl_loss_coef) instead")
        _check(self.ref_update_interval is None or self.ref_update_interval >= 1,
               f"algo.ref_update_interval={self.ref_update_interval}: must be >= 1, or null "
               "(the reference stays model.path)")
        _check(self.ref_update_interval is None or self.uses_reference,
               f"algo.ref_update_interval={self.ref_update_interval} refreshes the reference "
               "model, which this run does not load: set algo.kl_loss_coef > 0 (or "
               "algo.kl_coef > 0), or unset algo.ref_update_interval")
        _check(self.opsm_delta is None or self.opsm_delta >= 0,
               f"algo.opsm_delta={self.opsm_delta}: must be >= 0 or null")
        _check(self.tau_pos > 0 and self.tau_neg > 0,
               f"algo.tau_pos={self.tau_pos}, algo.tau_neg={self.tau_neg}: must be > 0")
        _check(self.opd_kl_coef >= 0, f"algo.opd_kl_coef={self.opd_kl_coef}: must be >= 0")
        _check(not self.opd_only_reward or self.teacher_model_path,
               "algo.opd_only_reward=true drops the task advantage for the teacher term alone: "
               "set algo.teacher_model_path (on-policy distillation), or unset opd_only_reward")
        _check(self.overlong_buffer_tokens >= 0,
               f"algo.overlong_buffer_tokens={self.overlong_buffer_tokens}: must be >= 0")
        _check(self.overlong_penalty_factor >= 0,
               f"algo.overlong_penalty_factor={self.overlong_penalty_factor}: must be >= 0")
        self._check_critic()

    @property
    def uses_critic(self) -> bool:
        """Whether the trainer trains a value model beside the policy (algo=ppo)."""
        return self.name in CRITIC_ALGOS

    def _check_critic(self) -> None:
        _check(0 <= self.gamma <= 1, f"algo.gamma={self.gamma}: must be in [0, 1]")
        _check(0 <= self.lam <= 1, f"algo.lam={self.lam}: must be in [0, 1]")
        _check(self.value_clip is None or self.value_clip > 0,
               f"algo.value_clip={self.value_clip}: must be > 0, or null (no clip)")
        _check(self.critic_lr is None or self.critic_lr > 0,
               f"algo.critic_lr={self.critic_lr}: must be > 0, or null (5 x trainer.lr)")
        _check(self.critic_warmup_steps >= 0,
               f"algo.critic_warmup_steps={self.critic_warmup_steps}: must be >= 0")
        _check(not self.critic_warmup_steps or self.uses_critic,
               f"algo.critic_warmup_steps={self.critic_warmup_steps} warms up a critic, which "
               f"algo={self.name} does not train: unset it, or use algo=ppo")


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
    groups_per_request: int = 1
    """Groups admitted together go to an engine in one batched /generate of at most this many
    groups (fewer HTTP round trips and bigger hf-engine batches; a batch returns when its
    slowest sequence ends, so keep 1 for long, uneven GPU generations)."""
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
    engine_tp_size: int = 1
    """sglang: GPUs per engine (--tp-size); the engine joins the weight sync as ranks
    rank_offset .. rank_offset + engine_tp_size - 1."""
    engine_ep_size: int = 1
    """sglang: expert parallel size inside an engine (--ep-size, MoE models; divides tp)."""
    engine_mem_fraction: float = 0.8
    """sglang: --mem-fraction-static, the GPU memory share for weights and KV cache."""
    engine_api_key: bool = True
    """sglang: servers require a key (--api-key): RELAX_ENGINE_API_KEY from the launcher's
    environment, else the run's secret (never in the config or a command line); every client
    sends it. hf engines require the same key whenever that variable is set."""
    engine_extra_args: list[str] = field(default_factory=list)
    """sglang: more `python -m sglang.launch_server` flags, passed as they are."""
    release_memory_during_train: bool = False
    """Colocated placement: engines release GPU memory (/release_memory_occupation) while the
    trainer steps and resume it for rollout; sglang engines then start --enable-memory-saver.
    Generation is paused first (weight_sync.pause_mode): SGLang asserts an idle engine."""
    return_routed_experts: bool = True
    """MoE models (ignored for dense ones): engines return the experts each token was routed
    to (SGLang's --enable-return-routed-experts), which ride with the samples for
    algo.routing_replay and the train/routing_mismatch_frac metric. Costs SGLang a host buffer
    of tokens x layers x top-k int32; false turns both off."""
    deterministic: bool = False
    """Reproducible rollouts: every sequence's tokens follow from its seed (run seed, group,
    sample), whatever else is batched, so a resumed run draws the same tokens. The hf engine
    always does this; sglang engines only with --enable-deterministic-inference, which this
    adds (a batch-invariant sampler and kernels: slower, see docs/engines.md#seeds). Without it
    SGLang ignores sampling_params.sampling_seed."""
    partial_rollout: bool = True
    """weight_sync.pause_mode=abort (ignored otherwise): a sequence a weight sync aborts
    continues from its prefix on the new weights (its sample then spans two versions, recorded
    in version_spans; docs/engines.md#pause-modes). false: the whole group is generated again
    from scratch, so every sample's tokens come from one version, at the price of the tokens
    thrown away. Multi-turn episodes and the agent proxy always do the latter."""
    agent_mode: str = "env"
    """env: the worker draws prompts from data.* and runs them (single-turn, or episodes of
    env.name); proxy: it serves an OpenAI-compatible /v1/chat/completions for external agent
    programs and trains on their sessions (docs/agentic.md)."""
    proxy_port: int = 0
    """agent_mode=proxy: the proxy's TCP port on the rollout node (0: a free one, written to
    RUN_DIR/plan.json and roles.json)."""
    proxy_session_timeout_s: float = 600.0
    """agent_mode=proxy: a group whose sessions see no request for this long is dropped (its
    admission credit goes back), so a crashed agent cannot stall the run."""
    proxy_admission_timeout_s: float = 300.0
    """agent_mode=proxy: how long the first request of a new group waits for an admission
    credit (the staleness bound) before it is answered 503."""

    def __post_init__(self) -> None:
        _check(self.agent_mode in ("env", "proxy"),
               f"rollout.agent_mode={self.agent_mode!r}: use env or proxy")
        _check(0 <= self.proxy_port < 65536, f"rollout.proxy_port={self.proxy_port}: 0..65535")
        _check(self.proxy_session_timeout_s > 0 and self.proxy_admission_timeout_s > 0,
               "rollout.proxy_session_timeout_s and rollout.proxy_admission_timeout_s must be > 0")
        _check(self.engine_tp_size >= 1, f"rollout.engine_tp_size={self.engine_tp_size}: >= 1")
        _check(self.engine_ep_size >= 1 and self.engine_tp_size % self.engine_ep_size == 0,
               f"rollout.engine_ep_size={self.engine_ep_size}: must divide "
               f"rollout.engine_tp_size={self.engine_tp_size}")
        _check(0 < self.engine_mem_fraction < 1,
               f"rollout.engine_mem_fraction={self.engine_mem_fraction}: must be in (0, 1)")
        _check(self.engine == "sglang" or (self.engine_tp_size == 1 and self.engine_ep_size == 1),
               f"rollout.engine_tp_size/engine_ep_size > 1 need rollout.engine=sglang "
               f"(rollout.engine={self.engine!r})")
        _check(self.engine in ("hf", "sglang"),
               f"rollout.engine={self.engine!r}: use hf (CPU) or sglang (GPU)")
        _check(self.num_engines >= 1, f"rollout.num_engines={self.num_engines}: must be >= 1")
        _check(self.batch_size >= 1, f"rollout.batch_size={self.batch_size}: must be >= 1")
        _check(self.n_samples_per_prompt >= 2,
               f"rollout.n_samples_per_prompt={self.n_samples_per_prompt}: GRPO needs >= 2 "
               "samples per prompt to compare")
        _check(self.groups_per_request >= 1,
               f"rollout.groups_per_request={self.groups_per_request}: must be >= 1")
        _check(self.max_new_tokens >= 1, f"rollout.max_new_tokens={self.max_new_tokens}: >= 1")
        _check(self.temperature > 0,
               f"rollout.temperature={self.temperature}: must be > 0 for RL sampling")


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
    """Export a Hugging Face directory every this many steps (0: never), for evaluation."""
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
    freeze_modules: list[str] = field(default_factory=list)
    """Parameter name prefixes not trained (still synced to engines), e.g. [model.visual] for
    a Qwen-VL vision tower or [model.audio_tower] for Qwen2-Audio's encoder."""
    streaming: Optional[bool] = None
    """Start forward/backward on complete groups as they arrive instead of waiting for the whole
    batch; the optimizer steps once all of the step's groups are in (same update as the whole
    batch). null: wherever it applies (algo.max_staleness >= 1, trainer=torch, a per-group
    estimator, a loss_reduction whose weights need no batch-wide token count); true: refused
    where it does not apply, with the reason; false: whole batches. See docs/algorithms.md."""

    def __post_init__(self) -> None:
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                    "expert_parallel_size"):
            _check(getattr(self, key) >= 1, f"trainer.{key}={getattr(self, key)}: must be >= 1")
        parallel = (self.tensor_parallel_size, self.pipeline_parallel_size,
                    self.context_parallel_size, self.expert_parallel_size)
        _check(self.backend == "megatron" or parallel == (1, 1, 1, 1),
               f"trainer.backend={self.backend}: tensor/pipeline/context/expert parallel sizes "
               "need trainer=megatron (the torch backend is data parallel only); set them to 1")
        _check(self.backend == "megatron" or not self.use_distributed_optimizer,
               f"trainer.backend={self.backend}: trainer.use_distributed_optimizer is the megatron "
               "backend's; with trainer=torch shard the optimizer with trainer.strategy=fsdp2, and "
               "set trainer.use_distributed_optimizer=false")
        _check(self.save_every >= 0, f"trainer.save_every={self.save_every}: must be >= 0")
        _check(self.keep_last >= 1, f"trainer.keep_last={self.keep_last}: keep at least 1")
        _check(self.backend in ("torch", "megatron"),
               f"trainer.backend={self.backend!r}: use torch or megatron")
        _check(self.strategy in ("ddp", "fsdp2"),
               f"trainer.strategy={self.strategy!r}: use ddp or fsdp2")
        _check(self.nproc_per_node >= 1, f"trainer.nproc_per_node={self.nproc_per_node}: >= 1")
        _check(self.total_steps >= 1, f"trainer.total_steps={self.total_steps}: >= 1")
        _check(self.lr > 0, f"trainer.lr={self.lr}: must be > 0")
        _check(self.warmup_steps >= 0, f"trainer.warmup_steps={self.warmup_steps}: >= 0")
        _check(self.lr_schedule in SCHEDULES,
               f"trainer.lr_schedule={self.lr_schedule!r}: use one of {', '.join(SCHEDULES)}")
        _check(self.lr_decay_steps is None or self.lr_decay_steps >= 1,
               f"trainer.lr_decay_steps={self.lr_decay_steps}: >= 1, or null for total_steps")
        _check(0.0 <= self.min_lr_ratio <= 1.0,
               f"trainer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        _check(self.micro_batch_size >= 1,
               f"trainer.micro_batch_size={self.micro_batch_size}: must be >= 1")
        _check(self.num_steps_per_rollout >= 1,
               f"trainer.num_steps_per_rollout={self.num_steps_per_rollout}: must be >= 1")


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
    multimodal_keys: dict[str, str] = field(default_factory=dict)
    """Media columns by kind, e.g. {image: images, video: videos, audio: audios}; the prompt's
    <image>, <video> and <audio> placeholders take the row's items in order
    (docs/multimodal.md)."""
    add_missing_placeholders: bool = False
    """A row whose prompt has no <image>/<video>/<audio> placeholder for its items gets one per item at
    the start of its first user message (datasets that keep the image beside the text)."""
    image_min_pixels: Optional[int] = None
    """Images smaller than this many pixels are upscaled; null: the image processor's own."""
    image_max_pixels: Optional[int] = None
    """Images larger than this many pixels are downscaled (bounds image tokens); null: own."""
    video_fps: float = 2.0
    """Frames kept per second of a video (a folder of frames is taken as shot at this rate)."""
    video_min_frames: int = 4
    """Fewest frames a video keeps; a video with fewer frames is a data error."""
    video_max_frames: int = 768
    """Most frames a video keeps (bounds video tokens with the pixels per frame)."""
    video_max_pixels: Optional[int] = None
    """Largest video frame in pixels (Qwen-VL's own video default: 602112 = 768 x 28 x 28);
    null: data.image_max_pixels. Video tokens <= frames / 2 x this / (patch x merge)^2."""
    audio_sampling_rate_hz: int = 16000
    """Audio is resampled to this rate before the feature extractor (Whisper-style: 16 kHz)."""
    media_num_workers: int = 4
    """Threads of the rollout worker that decode and process media (PIL and numpy release the
    GIL for most of it), so rollout is not bound by one core's decoding."""

    def __post_init__(self) -> None:
        _check(self.train_files == MISSING or len(self.train_files) > 0,
               "data.train_files is empty: set data.train_files=[path/to/train.jsonl]")
        bad = set(self.multimodal_keys) - {"image", "video", "audio"}
        _check(not bad, f"data.multimodal_keys has unknown kinds {sorted(bad)}: use image, "
               "video or audio, e.g. data.multimodal_keys={image: images}")
        _check(self.image_min_pixels is None or self.image_max_pixels is None
               or 0 < self.image_min_pixels <= self.image_max_pixels,
               f"data.image_min_pixels={self.image_min_pixels} must be > 0 and <= "
               f"data.image_max_pixels={self.image_max_pixels}")
        _check(self.video_fps > 0, f"data.video_fps={self.video_fps}: must be > 0")
        _check(1 <= self.video_min_frames <= self.video_max_frames,
               f"data.video_min_frames={self.video_min_frames} must be >= 1 and <= "
               f"data.video_max_frames={self.video_max_frames}")
        _check(self.video_max_pixels is None or self.image_min_pixels is None
               or 0 < self.image_min_pixels <= self.video_max_pixels,
               f"data.video_max_pixels={self.video_max_pixels} must be > 0 and >= "
               f"data.image_min_pixels={self.image_min_pixels}")
        _check(self.audio_sampling_rate_hz > 0,
               f"data.audio_sampling_rate_hz={self.audio_sampling_rate_hz}: must be > 0")
        _check(self.media_num_workers >= 1,
               f"data.media_num_workers={self.media_num_workers}: must be >= 1")


@dataclass(kw_only=True)
class RewardConfig:
    name: str = "exact_match"
    """A registered reward (see relax_slurm.rewards), boxed_<name>, or a dotted path
    module:function; a sample's metadata.rm_type overrides it."""
    num_workers: int = 4
    """Reward worker processes per rollout worker (the concurrency cap); 0 scores in the rollout
    worker's own process: no timeout and no isolation, no per-response IPC either (for pure,
    fast rule rewards such as exact_match and prefix_match)."""
    timeout_s: float = 60.0
    """Per-response time limit; a reward that takes longer scores 0 and counts as an error."""
    remote_url: Optional[str] = None
    """remote: the URL rewards are POSTed to."""
    remote_timeout_s: float = 30.0
    """remote: timeout of one attempt."""
    remote_max_retries: int = 3
    """remote: retries after a connection error, timeout, HTTP 429 or 5xx."""
    remote_backoff_s: float = 0.5
    """remote: wait before the first retry, doubled for each further one."""
    genrm_url: Optional[str] = None
    """genrm, dapo-genrm: base URL of a judge engine you run (hf engine or SGLang server;
    /generate). Exclusive with genrm_model_path."""
    genrm_model_path: Optional[str] = None
    """genrm, dapo-genrm: Hugging Face directory of a judge model relax-train serves itself on
    one more engine (role `genrm`, health-checked and restarted like the others, outside the
    weight sync). Exclusive with genrm_url."""
    genrm_template: Optional[str] = None
    """genrm, dapo-genrm: judge prompt with {prompt}, {response}, {label}; null: the built-in."""
    genrm_parser: str = "yes_no"
    """genrm: how to read the judge's answer: yes_no, score or exact_one."""
    genrm_max_score: float = 10.0
    """genrm, score parser: the judge's score is divided by this."""
    genrm_max_new_tokens: int = 512
    """genrm: tokens the judge may generate."""
    genrm_temperature: float = 0.0
    """genrm: judge sampling temperature (0: greedy)."""
    genrm_timeout_s: float = 50.0
    """genrm: timeout of one judge call."""

    def __post_init__(self) -> None:
        _check(self.num_workers >= 0, f"reward.num_workers={self.num_workers}: must be >= 0 "
               "(0: score in the rollout worker's process)")
        _check(self.timeout_s > 0, f"reward.timeout_s={self.timeout_s}: must be > 0")
        _check(self.remote_max_retries >= 0,
               f"reward.remote_max_retries={self.remote_max_retries}: must be >= 0")
        _check(self.remote_timeout_s > 0 and self.remote_backoff_s >= 0,
               "reward.remote_timeout_s must be > 0 and reward.remote_backoff_s >= 0")
        _check(self.genrm_parser in ("yes_no", "score", "exact_one"),
               f"reward.genrm_parser={self.genrm_parser!r}: use yes_no, score or exact_one")
        _check(self.genrm_max_score > 0,
               f"reward.genrm_max_score={self.genrm_max_score}: must be > 0")
        if self.name == "remote":
            _check(self.timeout_s >= self.remote_timeout_s,
                   f"reward.timeout_s={self.timeout_s} is below reward.remote_timeout_s="
                   f"{self.remote_timeout_s}: raise reward.timeout_s so one attempt fits")
        if self.name in ("genrm", "dapo-genrm", "dapo_rule_genrm"):
            _check(self.timeout_s >= self.genrm_timeout_s,
                   f"reward.timeout_s={self.timeout_s} is below reward.genrm_timeout_s="
                   f"{self.genrm_timeout_s}: raise reward.timeout_s so one judge call fits")


@dataclass(kw_only=True)
class WeightSyncConfig:
    backend: str = "auto"
    """auto (nccl with GPUs, gloo without), gloo or nccl."""
    bucket_mb: int = 512
    """Tensors are announced to engines in buckets of about this size."""
    timeout_s: float = 300.0
    verify: bool = False
    """After every sync, compare engine and trainer weight checksums (tests, debugging)."""
    overlap: bool = True
    """Async runs (algo.max_staleness >= 1): push each version from a background thread while
    the trainer checkpoints and takes, collates and trains on the next batch; only its
    optimizer step waits for the push (trainer/overlap.py). On-policy runs push in line (the
    worker waits for the new weights anyway)."""
    load_format: Optional[str] = None
    """null: one broadcast per tensor. flattened_bucket: one broadcast per bucket, its tensors'
    bytes end to end (SGLang's load_format of the same name; the hf engine serves both).
    Fewer collectives for models of many small tensors (MoE experts), at the price of one
    bucket-sized buffer and a copy on the sender (an hf engine receives into its parameters;
    see docs/weight_sync.md)."""
    pause_mode: str = "retract"
    """How engines pause while weights are sent (async runs, algo.max_staleness >= 1) and
    before they release memory (colocated): retract (running requests go back to the queue,
    keep their tokens and continue on the new weights; a sample then spans two versions, see
    meta_info.weight_versions), abort (they end with finish_reason abort; the worker continues
    them from their prefix, or with rollout.partial_rollout=false generates their groups
    again) or in_place (refused by every supported SGLang: the sync's
    cache flush cannot run beside requests paused in place). Checked against each engine's
    version when the weight-sync group forms."""

    def __post_init__(self) -> None:
        _check(self.backend in ("auto", "gloo", "nccl"),
               f"weight_sync.backend={self.backend!r}: use auto, gloo or nccl")
        _check(self.pause_mode in ("abort", "retract", "in_place"),
               f"weight_sync.pause_mode={self.pause_mode!r}: use retract, abort or in_place")
        _check(self.load_format in (None, FLATTENED_BUCKET),
               f"weight_sync.load_format={self.load_format!r}: use null (one broadcast per "
               f"tensor) or {FLATTENED_BUCKET}")


@dataclass(kw_only=True)
class BrokerConfig:
    request_timeout_s: float = 60.0
    """Timeout of one request/reply with the broker."""
    host: str = "127.0.0.1"
    """Interface the broker binds (local runs); on Slurm the node's address."""
    max_message_mb: int = 1024
    """Largest request the broker accepts, in MB; a peer sending more is disconnected."""
    spill: bool = True
    """Record the broker's state in RUN_DIR/broker/spill.bin so that it restarts in place (see
    operations.md); false: a dead broker is a global restart."""
    spill_fsync: bool = False
    """fsync every spill record (survives the machine going down, not just the broker)."""
    spill_compact_mb: int = 1024
    """Rewrite the spill file as a snapshot of the live state once it is larger than this."""

    def __post_init__(self) -> None:
        _check(self.max_message_mb >= 1, f"broker.max_message_mb={self.max_message_mb}: >= 1")
        _check(self.spill_compact_mb >= 1,
               f"broker.spill_compact_mb={self.spill_compact_mb}: >= 1")


@dataclass(kw_only=True)
class ClusterConfig:
    kind: str = "local"
    """local (subprocesses on this machine) or slurm (an sbatch job; see docs/slurm.md)."""
    step_timeout_s: float = 900.0
    """A run with no new step for this long is failed as hung."""
    trainer_cpus: Optional[list[int]] = None
    """Pin trainer ranks to these CPU ids (local runs); null leaves it to the OS."""
    rollout_cpus: Optional[list[int]] = None
    """Pin engines and rollout workers to these CPU ids (local runs)."""
    max_global_restarts: int = 0
    """Local runs: when a role dies or hangs, stop every role and start the run again from its
    latest checkpoint (trainer.save_every sets how much is redone), at most this many times."""
    max_role_restarts: int = 3
    """Restarts in place of one role that dies (the broker, from its spill file; see
    operations.md) before its next death fails the run (or restarts it globally)."""
    heartbeat_interval_s: float = 10.0
    """Trainer and rollout worker heartbeat to the broker this often, from their main loops; the
    launcher probes the broker's /status and the engines' /health as often."""
    heartbeat_timeout_s: float = 600.0
    """A role whose last heartbeat (or an engine whose last good /health, or a broker whose last
    /status) is older than this is hung: the run fails naming it, or restarts
    (cluster.max_global_restarts). Cover the longest step; 0 turns hang detection off."""

    elastic_timeout_s: float = 600.0
    """Elastic rollout: a scale_out without timeout_secs fails (and rolls back) after this long
    (see docs/operations.md)."""
    elastic_drain_timeout_s: float = 60.0
    """Elastic rollout: a scale_in waits this long for the worker's requests in flight on the
    leaving engines, then detaches them anyway (force=true does not wait)."""
    elastic_max_engines: int = 8
    """Elastic rollout: a num_replicas scale_out to more engines is refused (each is a process,
    on Slurm a job, with its own copy of the model)."""
    engine_job_partition: Optional[str] = None
    """Slurm elastic rollout: --partition of the job each added engine runs in; null: the
    rollout component's (rollout_partition, else partition)."""
    engine_job_cpus: Optional[int] = None
    """Slurm elastic rollout: --cpus-per-task of an engine job; null: cpus_per_task."""
    engine_job_gpus: Optional[int] = None
    """Slurm elastic rollout: --gpus-per-node of an engine job; null: rollout.engine_tp_size
    when the rollout component has GPUs (rollout_gpus_per_node, else gpus_per_node), else 0."""
    engine_job_time_min: Optional[int] = None
    """Slurm elastic rollout: --time of an engine job, in minutes; null: time_limit_min."""
    engine_job_mem_gb: Optional[int] = None
    """Slurm elastic rollout: --mem of an engine job in GB; null: the partition's default."""

    # ---- slurm: the allocation ------------------------------------------------------------
    layout: str = "hetjob"
    """hetjob (component 0: trainer + broker, component 1: engines + rollout worker) or
    colocated (one plain allocation; rollout roles on the nodes after the trainer's, or on the
    trainer's own nodes when rollout_nodes=0)."""
    partition: Optional[str] = None
    """--partition of the trainer component (and of the rollout one unless rollout_partition)."""
    rollout_partition: Optional[str] = None
    """--partition of the rollout component; null: same as partition."""
    account: Optional[str] = None
    """--account to charge; null: your default account."""
    qos: Optional[str] = None
    """--qos; null: the partition's default."""
    time_limit_min: int = 60
    """--time of each component, in minutes."""
    trainer_nodes: int = 1
    """Nodes running the torchrun trainer (one torchrun agent per node, c10d rendezvous)."""
    rollout_nodes: int = 1
    """Nodes running engines and the rollout worker; colocated layout: 0 shares the trainer's."""
    gpus_per_node: int = 0
    """--gpus-per-node of the trainer component (0: CPU only); match trainer.nproc_per_node."""
    rollout_gpus_per_node: Optional[int] = None
    """--gpus-per-node of the rollout component; null: same as gpus_per_node."""
    cpus_per_task: int = 4
    """--cpus-per-task; every component runs one task per node, so this is CPUs per node."""
    mem_gb: Optional[int] = None
    """--mem per node in GB; null: the partition's default; 0: all of the node's memory."""
    job_name: str = "relax"
    """--job-name; every role's srun step is named after the role."""

    # ---- slurm: preemption and time limits ------------------------------------------------
    requeue: bool = True
    """--requeue: a preempted or time-limited job goes back to the queue and resumes."""
    signal_lead_s: int = 120
    """--signal=B:USR1@N: seconds before the time limit the driver is told to checkpoint and
    requeue (Slurm may deliver it up to ~30 s late; keep it >= 60); 0: no signal."""
    preempt_timeout_s: float = 60.0
    """After that signal, how long the trainer may take to checkpoint and exit before the job is
    requeued anyway (resuming from the previous checkpoint)."""

    # ---- slurm: software on the nodes -----------------------------------------------------
    python: Optional[str] = None
    """Python of the driver and every role on the nodes; null: the one running relax-train."""
    setup_lines: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before the driver (module load, source venv, ...)."""
    container_image: Optional[str] = None
    """pyxis/enroot image for every role's srun (--container-image); null: no container."""
    container_mounts: list[str] = field(default_factory=list)
    """--container-mounts entries (SRC:DST); the run directory and the working directory
    must be visible inside."""
    container_prefix: list[str] = field(default_factory=list)
    """Words put before every role's command inside srun, e.g. [apptainer, exec, --nv,
    image.sif]; the alternative to container_image for Apptainer/Singularity."""
    container_python: str = "python"
    """Python inside the container (used when container_image or container_prefix is set)."""
    extra_sbatch_args: list[str] = field(default_factory=list)
    """More sbatch options for every component, e.g. [--constraint=a100, --exclusive]."""
    extra_srun_args: list[str] = field(default_factory=list)
    """More srun options for every role's step, e.g. [--mpi=none, --cpu-bind=none]."""

    # ---- slurm: submission ----------------------------------------------------------------
    wait: bool = False
    """relax-train blocks until the job ends (requeues included) and exits with its status."""
    wait_poll_s: float = 10.0
    """With wait=true, seconds between two looks at squeue."""
    dry_run: bool = False
    """relax-train prints the sbatch script and the srun lines, and submits nothing."""

    def __post_init__(self) -> None:
        _check(self.kind in ("local", "slurm"), f"cluster.kind={self.kind!r}: use local or slurm")
        _check(self.layout in ("hetjob", "colocated"),
               f"cluster.layout={self.layout!r}: use hetjob or colocated")
        _check(self.trainer_nodes >= 1, f"cluster.trainer_nodes={self.trainer_nodes}: >= 1")
        min_rollout = 1 if self.layout == "hetjob" else 0
        _check(self.rollout_nodes >= min_rollout,
               f"cluster.rollout_nodes={self.rollout_nodes}: must be >= {min_rollout} with "
               f"cluster.layout={self.layout} (colocated may share the trainer's nodes with 0)")
        _check(self.time_limit_min >= 1, f"cluster.time_limit_min={self.time_limit_min}: >= 1")
        _check(self.gpus_per_node >= 0 and (self.rollout_gpus_per_node or 0) >= 0,
               "cluster.gpus_per_node and cluster.rollout_gpus_per_node must be >= 0")
        _check(self.cpus_per_task >= 1, f"cluster.cpus_per_task={self.cpus_per_task}: >= 1")
        _check(self.mem_gb is None or self.mem_gb >= 0,
               f"cluster.mem_gb={self.mem_gb}: must be >= 0 or null")
        _check(0 <= self.signal_lead_s < self.time_limit_min * 60,
               f"cluster.signal_lead_s={self.signal_lead_s}: must be >= 0 and below "
               f"cluster.time_limit_min={self.time_limit_min} minutes")
        _check(self.preempt_timeout_s > 0 and (
                   self.signal_lead_s == 0 or self.preempt_timeout_s < self.signal_lead_s),
               f"cluster.preempt_timeout_s={self.preempt_timeout_s}: must be > 0 and below "
               f"cluster.signal_lead_s={self.signal_lead_s} so the requeue happens before the end")
        _check(not (self.container_image and self.container_prefix),
               "cluster.container_image (pyxis) and cluster.container_prefix (apptainer) are "
               "alternatives: set one of them")
        _check(self.wait_poll_s > 0, f"cluster.wait_poll_s={self.wait_poll_s}: must be > 0")
        _check(self.max_role_restarts >= 0,
               f"cluster.max_role_restarts={self.max_role_restarts}: >= 0")
        _check(self.heartbeat_interval_s > 0 and (
                   self.heartbeat_timeout_s == 0
                   or self.heartbeat_timeout_s >= 2 * self.heartbeat_interval_s),
               f"cluster.heartbeat_timeout_s={self.heartbeat_timeout_s}: must be 0 (off) or at "
               f"least twice cluster.heartbeat_interval_s={self.heartbeat_interval_s} (> 0)")
        _check(self.elastic_timeout_s > 0 and self.elastic_drain_timeout_s > 0
               and self.elastic_max_engines >= 1,
               f"cluster.elastic_timeout_s={self.elastic_timeout_s} and cluster."
               f"elastic_drain_timeout_s={self.elastic_drain_timeout_s} must be > 0, cluster."
               f"elastic_max_engines={self.elastic_max_engines} >= 1")
        for key in ("engine_job_cpus", "engine_job_time_min"):
            value = getattr(self, key)
            _check(value is None or value >= 1, f"cluster.{key}={value}: >= 1 or null")
        for key in ("engine_job_gpus", "engine_job_mem_gb"):
            value = getattr(self, key)
            _check(value is None or value >= 0, f"cluster.{key}={value}: >= 0 or null")


@dataclass(kw_only=True)
class WandbConfig:
    enabled: bool = False
    """Log every metrics row to Weights & Biases as well (needs `pip install wandb`)."""
    mode: str = "auto"
    """auto: online when WANDB_API_KEY is set, offline otherwise; or online, offline."""
    project: str = "relax-slurm"
    entity: Optional[str] = None
    """wandb team or user; null: the API key's default entity."""
    name: Optional[str] = None
    """Run name; null: the run directory's name."""
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.mode in ("auto", "online", "offline"),
               f"metrics.wandb.mode={self.mode!r}: use auto, online or offline")


@dataclass(kw_only=True)
class MetricsConfig:
    progress: bool = True
    """Progress bar on a terminal, plain lines otherwise."""
    log_every: int = 1
    tensorboard: bool = False
    """Also write TensorBoard event files to run_dir/tensorboard (needs `pip install tensorboard`)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(kw_only=True)
class EvalConfig:
    every: int = 0
    """Evaluate on the engines every this many steps (and after the last); 0 disables."""
    datasets: list[str] = field(default_factory=list)
    """jsonl / parquet files read like data.train_files (same keys); metrics are named after
    each file's stem: eval/<stem>/mean@k, eval/<stem>/pass@k."""
    n_samples: int = 1
    """k: responses per prompt. 1 with temperature 0 is greedy accuracy."""
    temperature: float = 0.0
    """0 is greedy; use > 0 with n_samples > 1 for pass@k."""
    max_prompts: int = 0
    """Evaluate the first this many prompts of each dataset; 0: all."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"eval.every={self.every}: must be >= 0")
        _check(self.every == 0 or len(self.datasets) > 0,
               f"eval.every={self.every} but eval.datasets is empty: set "
               "eval.datasets=[path/to/test.jsonl] or eval.every=0")
        _check(self.n_samples >= 1, f"eval.n_samples={self.n_samples}: must be >= 1")
        _check(self.temperature > 0 or self.n_samples == 1,
               f"eval.n_samples={self.n_samples} with eval.temperature=0 draws the same greedy "
               "response k times: set eval.temperature (e.g. 0.6) or eval.n_samples=1")


@dataclass(kw_only=True)
class DebugConfig:
    dump_rollouts: bool = False
    """Write every trained sample (prompt, response, reward, version) to
    run_dir/rollouts/step_NNNNNN.jsonl, one file per step."""


@dataclass(kw_only=True)
class NotifyConfig:
    urls: list[str] = field(default_factory=list)
    """Apprise URLs (slack://..., mailto://..., json://host:port/...); empty: no notifications.
    Needs `pip install apprise`; without it the run warns once and goes on."""
    every_steps: int = 0
    """Also send the latest key metrics every this many steps; 0: only start, end and crash."""

    def __post_init__(self) -> None:
        _check(self.every_steps >= 0, f"notify.every_steps={self.every_steps}: must be >= 0")


@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn (agentic) rollouts: an environment answers each model turn (docs/agentic.md).
    Without `env.name` every sample is one model turn scored by the reward function."""

    name: Optional[str] = None
    """A registered environment (tool, arith_feedback, ...) or `package.module:attr`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment, one instance per episode."""
    max_turns: int = 4
    """Model turns per episode; an episode cut here is marked truncated."""
    max_total_tokens: int = 512
    """Prompt + every turn and observation of an episode (rollout.max_new_tokens bounds each
    model turn); an episode that would pass it ends, marked truncated."""
    reward_source: str = "env"
    """env: the environment's reward of the last step; reward_fn: the reward function (reward.*)
    on the last model turn, the final answer (e.g. env=tool with reward=math)."""
    turn_reward_coef: float = 0.0
    """The episode's reward is that final reward plus this x the earlier turns' rewards from the
    environment (per-turn shaping; 0: the final reward only)."""

    def __post_init__(self) -> None:
        _check(self.reward_source in ("env", "reward_fn"),
               f"env.reward_source={self.reward_source!r}: use env or reward_fn")
        _check(self.max_turns >= 1, f"env.max_turns={self.max_turns}: must be >= 1")
        _check(self.max_total_tokens >= 2,
               f"env.max_total_tokens={self.max_total_tokens}: must be >= 2")


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised fine-tuning (`algo=sft`, trainer/sft.py): rows of data.train_files with their
    targets; the trainer alone runs, one optimizer step per `batch_size` rows."""

    response_key: str = "response"
    """Column holding the target answer (a string) to data.prompt_key's prompt."""
    messages_key: Optional[str] = None
    """Column of chat conversations ({role, content} lists); when set it replaces the prompt
    and response columns and every assistant turn is trained (verl's multiturn messages)."""
    batch_size: int = 32
    """Rows per optimizer step (all data-parallel ranks together); divides by their count."""
    max_tokens: int = 1024
    """Rows longer than this (prompt + response tokens) are dropped, with a count logged."""
    val_files: list[str] = field(default_factory=list)
    """Held-out rows (same columns) whose token-mean NLL is logged as val/loss; empty: none."""
    val_every: int = 0
    """Steps between validations (also after the last step when val_files are set); 0: at the
    end only."""

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, f"sft.batch_size={self.batch_size}: must be >= 1")
        _check(self.max_tokens >= 2, f"sft.max_tokens={self.max_tokens}: must be >= 2")
        _check(self.val_every >= 0, f"sft.val_every={self.val_every}: must be >= 0")


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
    resume_with_changes: bool = False
    """Allow a resume whose config differs from the one its checkpoint's steps ran with (in
    keys that change what a step computes; see launch/rerun.py); recorded in
    run_dir/config_history.jsonl."""
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
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def __post_init__(self) -> None:
        # every sampling_seed is (seed << 40) + group * n + index (rollout/sampling.py
        # sample_seed), and SGLang refuses seeds outside int64
        _check(0 <= self.seed < SEED_LIMIT,
               f"seed={self.seed}: must be in [0, {SEED_LIMIT}) (it is shifted 40 bits into "
               "every sampling_seed, which engines take as a signed 64-bit integer)")
        buffer, max_new = self.algo.overlong_buffer_tokens, self.rollout.max_new_tokens
        _check(buffer == 0 or buffer < max_new,
               f"algo.overlong_buffer_tokens={buffer} must be below rollout.max_new_tokens="
               f"{max_new} (the penalty ramps up over the last buffer tokens before the limit): "
               "lower algo.overlong_buffer_tokens (about a fifth of max_new_tokens) or set it to 0")
        # shared GPUs: engines hold no memory while the trainer steps, so nothing may generate
        # then; only the on-policy schedule (rollout, then train) guarantees that
        _check(self.rollout.agent_mode == "env" or not self.env.name,
               "rollout.agent_mode=proxy: external agents play the environment's part; unset "
               "env.name (env=none), or use rollout.agent_mode=env")
        _check(not self.rollout.release_memory_during_train or self.algo.max_staleness == 0,
               f"rollout.release_memory_during_train=true needs algo.max_staleness=0 (engines "
               f"are asleep while the trainer steps; got {self.algo.max_staleness})")
        t = self.trainer
        world = t.nproc_per_node * self.cluster.trainer_nodes
        model_parallel = t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size
        _check(world % model_parallel == 0,
               f"{world} trainer ranks (trainer.nproc_per_node x cluster.trainer_nodes) do not "
               f"split into trainer.tensor_parallel_size={t.tensor_parallel_size} x "
               f"pipeline_parallel_size={t.pipeline_parallel_size} x context_parallel_size="
               f"{t.context_parallel_size}: change trainer.nproc_per_node or the parallel sizes")
        data_parallel = world // model_parallel
        _check(data_parallel % t.expert_parallel_size == 0,
               f"trainer.expert_parallel_size={t.expert_parallel_size} must divide the data-"
               f"parallel size {data_parallel} (ranks / (TP x PP x CP)): change it or "
               "trainer.nproc_per_node")
        # the megatron backend trains Qwen2.5-VL / Qwen3-VL (dense) on images, TP only; the
        # architecture itself is checked when the model loads (trainer/megatron/vl.py)
        mm_kinds = set(self.data.multimodal_keys) - {"image"}
        _check(t.backend != "megatron" or not mm_kinds,
               f"trainer=megatron trains vision-language models on images only "
               f"(data.multimodal_keys has {sorted(mm_kinds)}): use trainer=torch for video and "
               "audio (docs/backends.md#multimodal-models)")
        _check(t.backend != "megatron" or not self.data.multimodal_keys
               or (t.pipeline_parallel_size == 1 and t.context_parallel_size == 1),
               "trainer=megatron with data.multimodal_keys supports tensor parallelism only: set "
               "trainer.pipeline_parallel_size=1 and trainer.context_parallel_size=1 "
               "(docs/backends.md#multimodal-models)")
        _check(not self.algo.routing_replay or self.rollout.return_routed_experts,
               "algo.routing_replay=true replays the experts the engines report: set "
               "rollout.return_routed_experts=true")
        _check(not self.algo.routing_replay or t.context_parallel_size == 1,
               "algo.routing_replay=true with trainer.context_parallel_size > 1 is not supported "
               "yet: the replayed routing is not split across context-parallel ranks "
               "(docs/algorithms.md#routing-replay)")
        steps = t.num_steps_per_rollout
        samples = self.rollout.batch_size * self.rollout.n_samples_per_prompt
        _check(samples % steps == 0,
               f"trainer.num_steps_per_rollout={steps} must divide the batch's "
               f"rollout.batch_size x rollout.n_samples_per_prompt = {samples} samples (equal "
               "mini-batches): change one of them")
        _check(t.backend == "torch" or not self.algo.uses_critic,
               f"algo={self.algo.name} with trainer=megatron is not supported yet: the critic "
               "(value model) is a component of the torch backend only; use trainer=torch "
               "(docs/algorithms.md#ppo-with-a-critic)")
        r = self.reward  # (the run plan fills genrm_url in for a managed judge: runtime/plan.py)
        _check(not (r.genrm_url and r.genrm_model_path),
               f"reward.genrm_url={r.genrm_url} and reward.genrm_model_path="
               f"{r.genrm_model_path} are both set: set genrm_url for a judge you run, or "
               "genrm_model_path for one relax-train serves, not both")
        blockers = self.streaming_blockers()
        _check(not (t.streaming and blockers),
               "trainer.streaming=true does not apply to this run: " + "; ".join(blockers)
               + ". Set trainer.streaming=null (streams where it applies) or false")
        problems = self.supervised_problems()
        _check(not problems, "; ".join(problems))

    def streaming_blockers(self) -> list[str]:
        """Why this run cannot train on groups as they arrive (empty: it can)."""
        out = []
        if self.algo.max_staleness < 1:
            out.append("algo.max_staleness=0 (on-policy: the whole batch is generated with one "
                       "version and sync runs stay bitwise reproducible)")
        if self.trainer.backend != "torch":
            out.append(f"trainer.backend={self.trainer.backend} (megatron's schedule reduces "
                       "gradients at the end of every forward_backward call and needs the "
                       "micro-batch count up front)")
        if self.algo.name in BATCH_WIDE_ADVANTAGE_ALGOS:
            out.append(f"algo={self.algo.name} (its advantages use the whole batch's rewards)")
        if self.algo.uses_critic:
            out.append(f"algo={self.algo.name} (its GAE advantages are whitened over the whole "
                       "batch's tokens, from the critic's values before its update)")
        if self.trainer.num_steps_per_rollout > 1:
            out.append(f"trainer.num_steps_per_rollout={self.trainer.num_steps_per_rollout} "
                       "(the old log-probs of the whole batch are taken before its first "
                       "optimizer step)")
        if self.algo.loss_reduction == "token_mean":
            out.append("algo.loss_reduction=token_mean (its weights divide by the whole batch's "
                       "token count)")
        return out

    @property
    def supervised(self) -> bool:
        """An SFT run: the trainer alone, on a dataset's targets (trainer/sft.py)."""
        return self.algo.name in SUPERVISED_ALGOS

    def supervised_problems(self) -> list[str]:
        """What an SFT run's config gets wrong (empty: nothing, or not an SFT run). Its loss
        goes through the shared policy_loss with the rows' log-probs standing in for an
        engine's (there is none), so the knobs that read those must be off."""
        if not self.supervised:
            return []
        a, out = self.algo, []
        if a.tis_clip is not None or a.opsm_delta is not None:
            out.append("algo=sft has no rollout log-probs to correct against: set "
                       "algo.tis_clip=null and algo.opsm_delta=null")
        if a.old_logprobs == "rollout" or a.max_staleness:
            out.append("algo=sft trains on a dataset, not on rollouts: set "
                       "algo.old_logprobs=auto and algo.max_staleness=0")
        if self.rollout.temperature != 1.0:
            out.append(f"algo=sft's NLL is of the model's own distribution, but "
                       f"rollout.temperature={self.rollout.temperature} scales the trainer's "
                       "logits: set rollout.temperature=1.0")
        if self.data.multimodal_keys:
            out.append("algo=sft reads text rows only (multimodal SFT is not implemented): "
                       "unset data.multimodal_keys")
        return out

    @property
    def streams(self) -> bool:
        """Whether the trainer takes a step's groups as they arrive (trainer.streaming)."""
        return self.trainer.streaming is not False and not self.streaming_blockers()
