"""`algo`: the advantage estimator and loss, and the algorithm names a config may choose."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from relax_slurm.config.algo_params import EstimatorParams, estimator_params
from relax_slurm.config.check import check

# Names registered in relax_slurm.algos (checked against its registry by a unit test), kept here
# so that validating a config does not import torch.
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
        check(self.name in ALGO_NAMES,
               f"algo.name={self.name!r}: choose one of {', '.join(ALGO_NAMES)} (algo=<name>)")
        check(self.max_staleness >= 0,
               f"algo.max_staleness={self.max_staleness}: must be >= 0 (0 = on-policy)")
        check(self.eps_clip > 0, f"algo.eps_clip={self.eps_clip}: must be > 0")
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        check(self.eps_clip_high > 0, f"algo.eps_clip_high={self.eps_clip_high}: must be > 0")
        if self.eps_clip_c is not None:
            check(self.eps_clip_c > 1,
                   f"algo.eps_clip_c={self.eps_clip_c}: must be > 1 (the cap is eps_clip_c x |A|, "
                   "above the clipped objective's 1 - eps_clip), or null")
            check(self.name in PPO_CLIP_ALGOS,
                   f"algo.eps_clip_c (dual-clip) caps PPO's clipped objective, which "
                   f"algo={self.name} does not have (cispo weights by a clipped ratio, sapo "
                   "gates softly): unset it")
        check(self.loss_reduction in ("seq_mean_token_mean", "token_sum", "token_mean"),
               f"algo.loss_reduction={self.loss_reduction!r}: use seq_mean_token_mean, "
               "token_sum or token_mean")
        check(self.old_logprobs in ("auto", "recompute", "rollout"),
               f"algo.old_logprobs={self.old_logprobs!r}: use auto, recompute or rollout")
        if self.old_logprobs == "auto":
            # measured on the tiny run at max_staleness=2: recompute+TIS peaked near 0.3 and fell
            # back, rollout reached 0.84 by step 100
            self.old_logprobs = "rollout" if self.max_staleness > 0 else "recompute"
        check(self.tis_clip is None or self.tis_clip > 0,
               f"algo.tis_clip={self.tis_clip}: must be > 0 or null")
        self._check_terms()
        self.estimator_params()  # a parameter its functions read, of the wrong type: named now

    def estimator_params(self) -> EstimatorParams:
        """algo.name's parameters, typed (relax_slurm/config/algo_params.py)."""
        return estimator_params(self.name, self)

    @property
    def uses_reference(self) -> bool:
        """Whether the trainer loads a frozen reference model (a KL to it is in the loss)."""
        return self.kl_loss_coef > 0 or self.kl_coef > 0

    def _check_terms(self) -> None:
        check(self.tis_type in ("truncate", "icepop"),
               f"algo.tis_type={self.tis_type!r}: use truncate or icepop")
        if self.tis_type == "icepop":
            check(self.tis_clip is not None,
                   "algo.tis_type=icepop needs a band: set algo.tis_clip (e.g. 5.0)")
            low = self.tis_clip_low if self.tis_clip_low is not None else 1.0 / self.tis_clip
            check(0 <= low < self.tis_clip,
                   f"algo.tis_clip_low={self.tis_clip_low}: must be >= 0 and below "
                   f"algo.tis_clip={self.tis_clip}")
        check(self.entropy_coef >= 0, f"algo.entropy_coef={self.entropy_coef}: must be >= 0")
        check(self.kl_loss_coef >= 0, f"algo.kl_loss_coef={self.kl_loss_coef}: must be >= 0")
        check(self.kl_loss_type in ("k1", "k2", "k3", "low_var_kl"),
               f"algo.kl_loss_type={self.kl_loss_type!r}: use k1, k2, k3 or low_var_kl")
        check(self.kl_coef >= 0, f"algo.kl_coef={self.kl_coef}: must be >= 0")
        check(not self.kl_coef or self.name not in NO_REWARD_KL_ALGOS,
               f"algo.kl_coef={self.kl_coef}: algo={self.name} has no place for a reward-side KL "
               "(its advantage is built from the completion-level reward alone: a leave-one-out "
               "baseline for rloo, a group baseline whitened over the batch for "
               "reinforce_plus_plus_baseline, as in Relax's spec); set algo.kl_coef=0 and use "
               "the KL loss (algo.kl_loss_coef) instead")
        check(self.ref_update_interval is None or self.ref_update_interval >= 1,
               f"algo.ref_update_interval={self.ref_update_interval}: must be >= 1, or null "
               "(the reference stays model.path)")
        check(self.ref_update_interval is None or self.uses_reference,
               f"algo.ref_update_interval={self.ref_update_interval} refreshes the reference "
               "model, which this run does not load: set algo.kl_loss_coef > 0 (or "
               "algo.kl_coef > 0), or unset algo.ref_update_interval")
        check(self.opsm_delta is None or self.opsm_delta >= 0,
               f"algo.opsm_delta={self.opsm_delta}: must be >= 0 or null")
        check(self.tau_pos > 0 and self.tau_neg > 0,
               f"algo.tau_pos={self.tau_pos}, algo.tau_neg={self.tau_neg}: must be > 0")
        check(self.opd_kl_coef >= 0, f"algo.opd_kl_coef={self.opd_kl_coef}: must be >= 0")
        check(not self.opd_only_reward or self.teacher_model_path,
               "algo.opd_only_reward=true drops the task advantage for the teacher term alone: "
               "set algo.teacher_model_path (on-policy distillation), or unset opd_only_reward")
        check(self.overlong_buffer_tokens >= 0,
               f"algo.overlong_buffer_tokens={self.overlong_buffer_tokens}: must be >= 0")
        check(self.overlong_penalty_factor >= 0,
               f"algo.overlong_penalty_factor={self.overlong_penalty_factor}: must be >= 0")
        self._check_critic()

    @property
    def uses_critic(self) -> bool:
        """Whether the trainer trains a value model beside the policy (algo=ppo)."""
        return self.name in CRITIC_ALGOS

    def _check_critic(self) -> None:
        check(0 <= self.gamma <= 1, f"algo.gamma={self.gamma}: must be in [0, 1]")
        check(0 <= self.lam <= 1, f"algo.lam={self.lam}: must be in [0, 1]")
        check(self.value_clip is None or self.value_clip > 0,
               f"algo.value_clip={self.value_clip}: must be > 0, or null (no clip)")
        check(self.critic_lr is None or self.critic_lr > 0,
               f"algo.critic_lr={self.critic_lr}: must be > 0, or null (5 x trainer.lr)")
        check(self.critic_warmup_steps >= 0,
               f"algo.critic_warmup_steps={self.critic_warmup_steps}: must be >= 0")
        check(not self.critic_warmup_steps or self.uses_critic,
               f"algo.critic_warmup_steps={self.critic_warmup_steps} warms up a critic, which "
               f"algo={self.name} does not train: unset it, or use algo=ppo")
