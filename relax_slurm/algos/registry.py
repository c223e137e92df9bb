"""Algorithms by name: each is an advantage estimator plus a per-token policy loss.

Adding an algorithm is one file that calls `register(...)` and one YAML under `conf/algo/`
(and its name in `relax_slurm.config.algo.ALGO_NAMES`, which validates `algo.name` without
importing torch, with the types of its parameters in `relax_slurm.config.algo_params.PARAMS_OF`).
The trainer only ever calls `compute_advantages` and `policy_loss` with `algo.name` and the
algorithm's typed parameters, built once from the validated `algo` section
(`AlgoConfig.estimator_params()`, `params=`), plus `policy_loss`'s own knobs as keywords.
Tests and tools may pass the estimator's parameters as keywords instead (`algo.*` names, the
others at the section's defaults); they are typed per call then (`estimator_params`: a wrong
type names the `algo.*` field).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable

from torch import Tensor

from relax_slurm.algos.common import (
    distilled_advantages, importance_weights, kl_penalty, kl_to_go, opsm_keep,
)
from relax_slurm.algos.reduce import reduce as reduce_tokens
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.algo_params import EstimatorParams, estimator_params

# (rewards [B, G], its typed parameters) -> advantages [B, G]
AdvantageFn = Callable[[Tensor, Any], Tensor]
# (logp, old_logp, advantages, loss_mask, its typed parameters) -> (token loss [N, T],
# clipped 0/1 [N, T]) or (token loss, clipped, metrics): extra mask-weighted metric sums such
# as opd_reverse_kl
TokenLossFn = Callable[..., tuple]
# what a direct call leaves out takes the algo section's default
ALGO_DEFAULTS = {f.name: f.default for f in fields(AlgoConfig) if f.default is not MISSING}


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: AdvantageFn
    token_loss: TokenLossFn
    needs_teacher: bool = False
    """Refuse to compute the loss without teacher log-probs (algo=opd)."""
    kl_in_rewards: bool = False
    """The advantages already hold the reward-side KL (algo=ppo: in the token rewards before
    GAE), so `policy_loss` only logs it instead of folding it in."""


_ALGOS: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    if algo.name in _ALGOS:
        raise ValueError(f"algorithm {algo.name!r} registered twice")
    _ALGOS[algo.name] = algo
    return algo


def names() -> list[str]:
    return sorted(_ALGOS)


def get(name: str) -> Algorithm:
    try:
        return _ALGOS[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; choose one of {names()}") from None


def typed_params(name: str, params: EstimatorParams | None, knobs: dict[str, Any]
                 ) -> EstimatorParams:
    """`params` as given (the trainer's, built once), or the named algorithm's typed
    parameters from keywords (every `algo.*` field, or a few: the others at their defaults);
    ConfigError naming a field of the wrong type. Both at once is a mistake: keywords would
    be silently ignored."""
    if params is None:
        return estimator_params(name, {**ALGO_DEFAULTS, **knobs})
    if knobs:
        raise TypeError(f"algo={name}: pass the estimator's parameters typed (params=) or as "
                        f"keywords, not both (got params and {sorted(knobs)})")
    return params


def compute_advantages(name: str, rewards: Tensor, params: EstimatorParams | None = None,
                       **knobs) -> Tensor:
    """Advantages [B, G] for B prompts x G samples each, by the named algorithm's estimator;
    `params` its typed parameters, or `knobs` the `algo.*` fields they are built from."""
    return get(name).advantages(rewards, typed_params(name, params, knobs).advantages)


def policy_loss(
    name: str, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
    rollout_logprobs: Tensor | None = None, *, reduction: str = "seq_mean_token_mean",
    tis_clip: float | None = None, tis_type: str = "truncate", tis_clip_low: float | None = None,
    opsm_delta: float | None = None, entropy: Tensor | None = None, entropy_coef: float = 0.0,
    ref_logprobs: Tensor | None = None, kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl", kl_coef: float = 0.0,
    teacher_logprobs: Tensor | None = None, opd_kl_coef: float = 1.0,
    opd_only_reward: bool = False, params: EstimatorParams | None = None, **knobs,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The named algorithm's loss over token tensors shaped [N, T]; returns (loss, metrics).
    `params`: the algorithm's typed parameters (`AlgoConfig.estimator_params()`), or `knobs`
    the `algo.*` fields they are built from (`typed_params`).

    `advantages` are per token (a sample's advantage broadcast over its tokens). Teacher
    log-probs (on-policy distillation, any estimator) first fold the teacher term into them,
    A_t <- A_t - opd_kl_coef * (old_logp_t - teacher_logp_t) (`common.distilled_advantages`; the
    task advantage dropped with `opd_only_reward`; logged as `opd_reverse_kl`). `kl_coef > 0`
    then folds the reward-side KL into them: A_t <- A_t - kl_coef * sum_{s >= t} kl_s, kl of
    `old_logprobs` to `ref_logprobs` (`kl_loss_type`, `common.kl_to_go`; logged as `reward_kl`;
    only logged for an algorithm whose advantages hold it already, `kl_in_rewards`).
    On top of the algorithm's per-token policy-gradient loss, in this order:
    - `rollout_logprobs`: importance weights against the engine (`common.importance_weights`,
      `tis_type` truncate or icepop, band `[tis_clip_low, tis_clip]`);
    - `opsm_delta`: off-policy sequence masking (`common.opsm_keep`) against the rollout
      log-probs (the old ones without rollout log-probs);
    - `entropy_coef * entropy` is subtracted (entropy [N, T] from the trainer, with gradient);
    - `kl_loss_coef * kl(logprobs, ref_logprobs)` is added (`kl_loss_type`, `common.kl_penalty`).
    `reduction="weighted_sum"` takes `loss_mask` as precomputed per-token weights (see
    `reduce.reduction_weights`), which makes the loss independent of how a batch is split over
    ranks and micro-batches. Metrics are mask-weighted sums (`clipped_tokens`, `tokens`, and
    when they apply `logprob_abs_diff`, `tis_masked_tokens`, `opsm_masked_tokens`, `entropy`,
    `kl_loss`, `opd_reverse_kl`) so callers add them across micro-batches and ranks, then
    divide by `tokens`.
    """
    algo = get(name)
    mask = (loss_mask != 0).float()
    advantages, shaping = _shaped_advantages(
        algo, advantages, old_logprobs, loss_mask, mask, ref_logprobs, teacher_logprobs,
        kl_coef=kl_coef, kl_loss_type=kl_loss_type, opd_kl_coef=opd_kl_coef,
        opd_only_reward=opd_only_reward)
    token_loss, metrics = _algorithm_loss(algo, logprobs, old_logprobs, advantages, loss_mask,
                                          mask, typed_params(name, params, knobs).loss)
    metrics.update(shaping)
    token_loss = _off_policy_corrected(
        token_loss, metrics, logprobs, old_logprobs, rollout_logprobs, advantages, loss_mask,
        mask, tis_clip=tis_clip, tis_type=tis_type, tis_clip_low=tis_clip_low,
        opsm_delta=opsm_delta)
    token_loss = _with_entropy_bonus(token_loss, metrics, entropy, entropy_coef, mask)
    token_loss = _with_kl_loss(token_loss, metrics, logprobs, ref_logprobs, kl_loss_coef,
                               kl_loss_type, mask)
    return reduce_tokens(token_loss, loss_mask, reduction), metrics


def _shaped_advantages(algo: Algorithm, advantages: Tensor, old_logprobs: Tensor,
                       loss_mask: Tensor, mask: Tensor, ref_logprobs: Tensor | None,
                       teacher_logprobs: Tensor | None, *, kl_coef: float, kl_loss_type: str,
                       opd_kl_coef: float, opd_only_reward: bool
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """The advantages with the teacher term and the reward-side KL folded in, and their
    metric sums (`opd_reverse_kl`, `reward_kl`)."""
    extra: dict[str, Tensor] = {}
    if teacher_logprobs is None and algo.needs_teacher:
        raise ValueError(f"algo={algo.name} needs the teacher's log-probs: pass "
                         "teacher_logprobs=[N, T] to policy_loss")
    if teacher_logprobs is not None:
        advantages = distilled_advantages(advantages, old_logprobs, teacher_logprobs,
                                          opd_kl_coef, opd_only_reward)
        gap = (old_logprobs.detach() - teacher_logprobs) * mask
        extra["opd_reverse_kl"] = gap.sum()
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError(f"algo.kl_coef={kl_coef} needs the reference model's log-probs: "
                             "pass ref_logprobs=[N, T] to policy_loss")
        if not algo.kl_in_rewards:
            to_go = kl_to_go(old_logprobs, ref_logprobs, loss_mask, kl_loss_type)
            advantages = advantages - kl_coef * to_go
        kl = kl_penalty(old_logprobs.detach(), ref_logprobs, kl_loss_type)
        extra["reward_kl"] = (kl * mask).sum()
    return advantages, extra


def _algorithm_loss(algo: Algorithm, logprobs: Tensor, old_logprobs: Tensor,
                    advantages: Tensor, loss_mask: Tensor, mask: Tensor, params: Any
                    ) -> tuple[Tensor, dict[str, Tensor]]:
    """The algorithm's own per-token loss and its metric sums (`clipped_tokens`, `tokens`, and
    whatever it reports itself)."""
    out = algo.token_loss(logprobs, old_logprobs, advantages, loss_mask, params)
    token_loss, clipped = out[0], out[1]
    metrics = {"clipped_tokens": (clipped * mask).sum().detach(), "tokens": mask.sum()}
    metrics.update(out[2] if len(out) > 2 else {})
    return token_loss, metrics


def _off_policy_corrected(token_loss: Tensor, metrics: dict[str, Tensor], logprobs: Tensor,
                          old_logprobs: Tensor, rollout_logprobs: Tensor | None,
                          advantages: Tensor, loss_mask: Tensor, mask: Tensor, *,
                          tis_clip: float | None, tis_type: str, tis_clip_low: float | None,
                          opsm_delta: float | None) -> Tensor:
    """The loss weighted against the engine's log-probs (TIS or icepop), then with off-policy
    sequences masked (OPSM); their metric sums go into `metrics`."""
    if rollout_logprobs is not None:
        w = importance_weights(old_logprobs, rollout_logprobs, tis_clip, tis_type, tis_clip_low)
        token_loss = token_loss * w
        gap = (logprobs.detach() - rollout_logprobs).abs()  # trainer vs engine
        metrics["logprob_abs_diff"] = (gap * mask).sum()
        if tis_type == "icepop":
            metrics["tis_masked_tokens"] = ((w == 0).float() * mask).sum()
    if opsm_delta is not None:
        behaviour = old_logprobs if rollout_logprobs is None else rollout_logprobs
        keep = opsm_keep(logprobs, behaviour, advantages, loss_mask, opsm_delta)  # [N, 1]
        token_loss = token_loss * keep
        metrics["opsm_masked_tokens"] = ((1.0 - keep) * mask).sum()
    return token_loss


def _with_entropy_bonus(token_loss: Tensor, metrics: dict[str, Tensor], entropy: Tensor | None,
                        entropy_coef: float, mask: Tensor) -> Tensor:
    """The loss minus entropy_coef x entropy; the entropy's sum goes into `metrics`."""
    if entropy_coef:
        if entropy is None:
            raise ValueError(f"algo.entropy_coef={entropy_coef} needs the per-token entropy: "
                             "pass entropy=[N, T] to policy_loss")
        token_loss = token_loss - entropy_coef * entropy
    if entropy is not None:
        metrics["entropy"] = (entropy.detach() * mask).sum()
    return token_loss


def _with_kl_loss(token_loss: Tensor, metrics: dict[str, Tensor], logprobs: Tensor,
                  ref_logprobs: Tensor | None, kl_loss_coef: float, kl_loss_type: str,
                  mask: Tensor) -> Tensor:
    """The loss plus kl_loss_coef x KL(policy || reference); the KL's sum goes into `metrics`
    whenever there is a reference."""
    if kl_loss_coef:
        if ref_logprobs is None:
            raise ValueError(f"algo.kl_loss_coef={kl_loss_coef} needs the reference model's "
                             "log-probs: pass ref_logprobs=[N, T] to policy_loss")
        kl = kl_penalty(logprobs, ref_logprobs, kl_loss_type)
        token_loss = token_loss + kl_loss_coef * kl
        metrics["kl_loss"] = (kl.detach() * mask).sum()
    elif ref_logprobs is not None:
        kl = kl_penalty(logprobs.detach(), ref_logprobs, kl_loss_type)
        metrics["kl_loss"] = (kl * mask).sum()
    return token_loss
