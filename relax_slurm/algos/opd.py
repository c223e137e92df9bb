"""On-policy distillation: a per-token pull towards a teacher's log-probs, on any estimator.

A_t <- A_t - opd_kl_coef * (logp_student_t - logp_teacher_t): a token the student likes more
than the teacher gets a lower advantage. In expectation over the student's own samples this is
the reverse KL(student || teacher), minimised on the states the student actually visits. The
teacher's log-probs of the sampled tokens come from a teacher engine (prefill of prompt +
response) and are passed in as `teacher_logprobs` [N, T], aligned with `logp`.

`policy_loss` applies the term to whatever estimator runs whenever it is given teacher
log-probs (a run with `algo.teacher_model_path`); `algo=opd` is GRPO that insists on them.
"""

from __future__ import annotations

from relax_slurm.algos.grpo import group_advantages, ppo_clip_token_loss
from relax_slurm.algos.registry import Algorithm, register


register(Algorithm(name="opd", advantages=group_advantages, token_loss=ppo_clip_token_loss,
                   needs_teacher=True))
