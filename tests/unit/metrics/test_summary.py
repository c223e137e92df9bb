

def test_samples_lost_counts_what_was_accepted_but_never_trained_dropped_or_queued():
    from relax_slurm.metrics.summary import samples_lost

    rows = [{"step": s, "train/samples": 8} for s in range(3)]  # 3 steps x 2 groups x 4
    counters = {"accepted": 9, "dropped": 1, "queue_depth": 2}
    assert samples_lost(counters, rows, batch_size=2, samples_per_group=4) == 0
    counters["accepted"] = 10  # one group vanished
    assert samples_lost(counters, rows, batch_size=2, samples_per_group=4) == 4
    # resumed from another run's step-5 checkpoint: its 10 groups count as trained
    rows = [{"step": s, "train/samples": 8} for s in range(5, 8)]
    counters = {"accepted": 19, "dropped": 1, "queue_depth": 2}
    assert samples_lost(counters, rows, batch_size=2, samples_per_group=4) == 0


def test_an_sft_run_summary_has_its_validation_losses():
    from relax_slurm.metrics.summary import summarize

    rows = [{"step": 0, "train/loss": 3.0}, {"step": 1, "val/loss": 2.0},
            {"step": 2, "train/loss": 1.0}, {"step": 3, "val/loss": 0.5}]
    out = summarize(rows, 1.0, 0)
    assert out["val_loss_first"] == 2.0 and out["val_loss_last"] == 0.5
    assert out["steps"] == 4 and out["reward_last"] is None
    assert "val_loss_first" not in summarize([{"step": 0, "rollout/reward_mean": 1.0}], 1.0, 0)
