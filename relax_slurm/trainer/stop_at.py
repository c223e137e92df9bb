"""`trainer.stop_at`: end a run once its reward reaches a target.

A learning run is usually given steps for its slowest case (a sweep's worst point, a test's
slowest seed x 2), and most of them are spent after the run has shown what it was run for.
With `trainer.stop_at.reward=R`, rank 0 keeps each step's mean reward (the metrics row's
rollout/reward_mean) and, after the first step at which the mean of the last
`trainer.stop_at.steps` of them is at least R, files a stop request itself
(runtime/control.py `request_stop`, the file `relax-ctl stop` writes): the trainer saves its
final checkpoint and exits 0 as on any stop, and summary.json's `stopped_early` records the
step and this reason. A run that never reaches R runs to trainer.total_steps. Either way
summary.json's `stop_at.reached_at_step` says where (and whether) the target was reached
(launch/supervisor.py, from metrics.jsonl: `metrics/summary.py` `first_reached`).
"""

from __future__ import annotations

from relax_slurm.config.trainer import StopAtConfig
from relax_slurm.metrics.summary import reached
from relax_slurm.samples import Group


def batch_reward(groups: list[Group]) -> float:
    """A step's mean reward over its samples: the metrics row's rollout/reward_mean."""
    samples = [s for g in groups for s in g]
    return sum(s.reward for s in samples) / len(samples)


class RewardTarget:
    """Rank 0's per-step rewards against `trainer.stop_at.reward` (None: no target)."""

    def __init__(self, cfg: StopAtConfig) -> None:
        self.target, self.window = cfg.reward, cfg.steps
        self.rewards: list[float] = []  # one a step, the steps consecutive up to last_step
        self.last_step: int | None = None

    @property
    def active(self) -> bool:
        return self.target is not None

    def note(self, done: int, groups: list[Group]) -> None:
        """Step `done`'s batch (called once per step, before its weight push)."""
        if self.active and groups and done != self.last_step:
            self.last_step = done
            self.rewards.append(batch_reward(groups))

    def stop_reason(self) -> str | None:
        """Why the run ends now (the stop request's reason), or None to carry on."""
        if not self.active:
            return None
        mean = reached(self.rewards, self.target, self.window)
        if mean is None:
            return None
        last = self.last_step
        return (f"trainer.stop_at.reward={self.target} reached at step {last}: mean "
                f"reward {mean:.4f} over steps {last - self.window + 1}-{last}")
