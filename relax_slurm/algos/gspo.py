"""GSPO: GRPO advantages with a sequence-level importance ratio in the PPO clip.

One ratio per sample, exp(mean over its tokens of logp - old_logp), so that a sample is clipped
as a whole: token-level ratios are noisy on long answers and on mixture-of-experts models,
whose routing changes between rollout and training.
"""

from __future__ import annotations

from torch import Tensor

from relax_slurm.algos.common import masked_row_mean, ppo_clip
from relax_slurm.algos.grpo import group_advantages
from relax_slurm.algos.registry import Algorithm, register
from relax_slurm.config.algo_params import ClipParams


def sequence_clip_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor,
                             loss_mask: Tensor, p: ClipParams) -> tuple[Tensor, Tensor]:
    """PPO-clip on the per-sequence mean log-ratio broadcast to the sequence's tokens, [N, T].

    The mean keeps its gradient, so each token receives 1/|tokens| of its sequence's gradient.
    """
    seq_log_ratio = masked_row_mean(logp - old_logp, loss_mask)  # [N, 1]
    return ppo_clip(seq_log_ratio.expand_as(logp), advantages, p.eps_clip, p.eps_clip_high,
                    p.eps_clip_c)


register(Algorithm(name="gspo", advantages=group_advantages, token_loss=sequence_clip_token_loss))
