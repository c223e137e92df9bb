"""The progress display counts steps by the step each row names, from the resumed step."""

from __future__ import annotations

import io

from tqdm import tqdm

from relax_slurm.metrics.progress import Progress


def rows(steps):
    return [{"step": s, "rollout/reward_mean": 0.5} for s in steps]


def test_bar_on_resume_starts_at_the_checkpoint_and_ends_at_the_total():
    p = Progress(150, start_step=75)
    p.bar = tqdm(total=150, initial=75, file=io.StringIO())  # what a terminal gets
    for row in rows([*range(75), *range(75, 150)]):  # the old rows re-read, then the new ones
        p.update(row)
        assert p.bar.n <= 150
    assert p.bar.n == 150


def test_plain_lines_name_steps_after_the_checkpoint(capsys):
    p = Progress(80, start_step=75)
    for row in rows(range(80)):
        p.update(row)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 76/80") and lines[-1].startswith("step 80/80"), lines


def test_an_sft_run_shows_its_loss_not_a_reward(capsys):
    p = Progress(2)
    p.update({"step": 0, "train/loss": 2.5, "sft/epoch": 0.01, "perf/step_time_s": 0.1})
    p.update({"step": 1, "train/loss": 1.25, "val/loss": 1.5, "sft/epoch": 0.02,
              "perf/step_time_s": 0.1})
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("step 2/2 loss=1.250 val=1.500 epoch=0.02 s/step=0.10"), last
    assert "reward" not in last
