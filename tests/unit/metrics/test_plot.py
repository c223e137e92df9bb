"""relax-plot: PNG panels from a (possibly still growing) metrics.jsonl."""

from __future__ import annotations

import json
import struct

import pytest

from relax_slurm.metrics.plot import PANELS, Panel, main, plot_run, series

pytest.importorskip("matplotlib")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        row = {"step": i, "rollout/reward_mean": i / n, "rollout/response_len_mean": 20 - i / 2,
               "rollout/truncated_frac": 0.1, "train/clipfrac": 0.01, "train/entropy": 2 - i / n,
               "train/rollout_train_logprob_diff": 1e-3, "broker/staleness_max": i % 3,
               "broker/staleness_mean": (i % 3) / 2, "broker/dropped_stale": 0,
               "perf/samples_per_s": 30.0, "perf/trainer_wait_s": 1.0,
               "perf/train_time_s": 0.5, "perf/weight_sync_s": 0.1, "perf/checkpoint_s": 0.0,
               "broker/staleness_hist/0": 1 - i / n, "broker/staleness_hist/1": i / n}
        if i % 4 == 3:
            row["eval/arith/mean@4"] = i / n
        rows.append(row)
    return rows


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_every_panel_with_data_is_a_png_named_after_it(tmp_path):
    lines = [json.dumps(r) for r in synthetic_rows(12)]
    # a running run: the last line is still being written
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 12, "rollout/rew')
    written = plot_run(tmp_path)
    names = {p.stem for p in written}
    assert names == {p.name for p in PANELS} | {"overview"}
    for path in written:
        assert path.parent == tmp_path / "plots"
        w, h = png_size(path)
        assert w > 300 and h > 200


def test_panels_without_data_are_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.5}))
    assert {p.stem for p in plot_run(tmp_path)} == {"reward", "overview"}


def test_series_expands_prefixes_and_skips_missing_points():
    rows = [{"step": 0, "eval/a/acc": 0.5}, {"step": 1}, {"step": 2, "eval/a/acc": 0.7,
                                                        "eval/b/acc": None}]
    assert series(rows, Panel("eval", "eval", ("eval/",))) == {"eval/a/acc": ([0, 2], [0.5, 0.7])}


def test_cli_writes_plots_and_fails_clearly_without_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(SystemExit, match="no metrics yet"):
        main([str(run)])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "perf/samples_per_s": 3.0}))
    main([str(run)])  # the console script's entry point, in-process: no second matplotlib import
    assert capsys.readouterr().out.split() == [str(run / "plots" / "throughput.png"),
                                               str(run / "plots" / "overview.png")]
