"""On-policy distillation: GRPO plus a per-token pull towards a teacher's log-probs.

A_t <- A_t - opd_kl_coef * (logp_student_t - logp_teacher_t): a token the student likes more
than the teacher gets a lower advantage. In expectation over the student's own samples this is
the reverse KL(student || teacher), minimised on the states the student actually visits. The
teacher's log-probs of the sampled tokens come from a teacher engine (prefill of prompt +
response) and are passed in as `teacher_logprobs` [N, T], aligned with `logp`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_slurm.algos.common import ppo_clip
from relax_slurm.algos.grpo import group_advantages
from relax_slurm.algos.registry import Algorithm, register


def distilled_advantages(
    advantages: Tensor, student_logp: Tensor, teacher_logp: Tensor, opd_kl_coef: float,
    opd_only_reward: bool = False,
) -> Tensor:
    """Token advantages [N, T] with the teacher term (no gradient); only_reward drops the task A."""
    base = torch.zeros_like(advantages) if opd_only_reward else advantages
    return base - opd_kl_coef * (student_logp.detach() - teacher_logp)


def distill_token_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor, *,
    teacher_logprobs: Tensor | None = None, opd_kl_coef: float = 1.0,
    opd_only_reward: bool = False, eps_clip: float = 0.2, eps_clip_high: float | None = None,
    eps_clip_c: float | None = None, **_: object,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """PPO-clip on the distilled advantages; reports `opd_reverse_kl` (mask-weighted sum)."""
    if teacher_logprobs is None:
        raise ValueError("algo=opd needs the teacher's log-probs: pass teacher_logprobs=[N, T] "
                         "to policy_loss")
    adv = distilled_advantages(advantages, old_logp, teacher_logprobs, opd_kl_coef,
                               opd_only_reward)
    loss, clipped = ppo_clip(logp - old_logp, adv, eps_clip, eps_clip_high, eps_clip_c)
    mask = (loss_mask != 0).float()
    reverse_kl = ((old_logp.detach() - teacher_logprobs) * mask).sum()
    return loss, clipped, {"opd_reverse_kl": reverse_kl}


register(Algorithm(name="opd", advantages=group_advantages, token_loss=distill_token_loss))
