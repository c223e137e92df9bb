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


def test_a_replaced_file_that_grew_past_the_offset_is_read_from_its_start(tmp_path):
    # the global-restart race seen in a chaos run: the resumed trainer cut the file at its
    # checkpoint and logged new steps before the launcher read again, so the new file was
    # already longer than the old read offset
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": "old"}) + "\n" for s in range(4)))
    tail = MetricsTail(path)
    assert [r["step"] for r in tail.new_rows()] == [0, 1, 2, 3]
    new = tmp_path / "metrics.tmp"
    new.write_text("".join(json.dumps({"step": s, "x": "resumed run"}) + "\n"
                           for s in range(8)))
    new.replace(path)
    rows = tail.new_rows()
    assert [r["step"] for r in rows] == list(range(8)) and tail.count == 8
