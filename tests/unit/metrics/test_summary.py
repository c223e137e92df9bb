

def test_samples_lost_counts_what_was_accepted_but_never_trained_dropped_or_queued():
    from relax_slurm.metrics.summary import samples_lost

    rows = [{"step": s, "train/samples": 8} for s in range(3)]  # 3 steps x 2 groups x 4
    status = {"counters": {"accepted": 9, "dropped": 1, "queue_depth": 2}}
    assert samples_lost(status, rows, batch_size=2, samples_per_group=4) == 0
    status["counters"]["accepted"] = 10  # one group vanished
    assert samples_lost(status, rows, batch_size=2, samples_per_group=4) == 4
    # resumed from another run's step-5 checkpoint: its 10 groups count as trained
    rows = [{"step": s, "train/samples": 8} for s in range(5, 8)]
    status = {"counters": {"accepted": 19, "dropped": 1, "queue_depth": 2}}
    assert samples_lost(status, rows, batch_size=2, samples_per_group=4) == 0
