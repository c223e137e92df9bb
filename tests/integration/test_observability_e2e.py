"""A tiny run with every observability output on: TensorBoard, offline wandb, rollout dumps,
periodic greedy eval, notifications to a local json:// receiver, then relax-plot."""

from __future__ import annotations

import json

import pytest

from relax_slurm.metrics.plot import plot_run
from tests.conftest import ONE_RANK, relax_train
from tests.json_receiver import json_receiver
from tests.unit.metrics.test_fanout import tb_scalars
from tests.unit.metrics.wandb_records import history_keys

STEPS = 4
KEYS = {"rollout/reward_mean", "train/loss", "broker/staleness_max", "perf/step_time_s"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_run_writes_tensorboard_wandb_dumps_notifications_and_plots(tmp_path, tiny_assets):
    for pkg in ("tensorboard", "wandb", "apprise", "matplotlib"):
        pytest.importorskip(pkg)
    run_dir = tmp_path / "run"
    with json_receiver() as (url, got):
        proc = relax_train(
            run_dir, tiny_assets, ONE_RANK, f"trainer.total_steps={STEPS}",
            "metrics.tensorboard=true", "metrics.wandb.enabled=true", "metrics.wandb.mode=offline",
            "debug.dump_rollouts=true", f"notify.urls=[{url}]", "notify.every_steps=2",
            "eval.every=2", f"eval.datasets=[{tiny_assets / 'arith_test.jsonl'}]",
            "eval.max_prompts=16",
            timeout_s=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    scalars = tb_scalars(run_dir / "tensorboard")
    for key in KEYS:
        assert [s for s, _ in scalars[key]] == list(range(STEPS)), key

    wandb_id = (run_dir / "wandb_id").read_text().strip()
    [run_file] = (run_dir / "wandb").glob(f"offline-run-*-{wandb_id}/run-{wandb_id}.wandb")
    assert KEYS <= history_keys(run_file)

    for step in range(STEPS):
        rows = [json.loads(x) for x in
                (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert rows and all(r["step"] == step and r["response"] is not None for r in rows)
        assert all(step - r["version_min"] >= 0 for r in rows)

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # eval after steps 2 and 4 (the rows of 0-based steps 1 and 3), greedy: k = 1
    assert [r["step"] for r in rows if "eval/arith_test/mean@1" in r] == [1, 3]
    assert 0.0 <= rows[3]["eval/arith_test/pass@1"] <= 1.0

    titles = [m["title"].split(": ", 1)[1] for m in got]
    assert titles == ["started", "step 2/4", "step 4/4", "finished"], titles

    assert {p.stem for p in plot_run(run_dir)} >= {"reward", "eval", "staleness",
                                                  "time_breakdown", "overview"}
