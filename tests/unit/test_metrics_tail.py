"""MetricsTail: the supervisor's incremental reader of metrics.jsonl."""

from __future__ import annotations

import json

from relax_slurm.metrics.jsonl import MetricsTail


def test_reads_only_new_complete_lines_and_restarts_after_truncation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.new_rows() == [] and tail.count == 0  # no file yet
    path.write_text(json.dumps({"step": 0}) + "\n" + '{"step": 1')  # a line being written
    assert tail.new_rows() == [{"step": 0}]
    with path.open("a") as f:
        f.write("}\n" + json.dumps({"step": 2}) + "\n")
    assert tail.new_rows() == [{"step": 1}, {"step": 2}] and tail.count == 3
    assert tail.new_rows() == []
    path.write_text(json.dumps({"step": 0}) + "\n")  # a resumed trainer truncated it
    assert tail.new_rows() == [{"step": 0}] and tail.count == 1
