"""find_latest / resolve_resume: pure filesystem rules, on fake checkpoint directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_slurm.checkpoint.resume import (
    clear_checkpoints, find_latest, list_checkpoints, parse_step, resolve_resume,
    resume_for_attempt,
)
from relax_slurm.errors import ConfigError


def fake(root: Path, name: str, complete: bool = True, saved: float | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (d / ".metadata").write_bytes(b"m")
        (d / "meta.json").write_text(json.dumps({} if saved is None else {"saved_unix": saved}))
    return d


def test_parse_step():
    assert parse_step("step_12") == 12
    assert parse_step("/a/b/step_0") == 0
    assert parse_step("step_12.tmp") is None and parse_step("latest") is None


def test_empty_and_missing(tmp_path):
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "nope") is None
    assert resolve_resume(tmp_path, "auto", overwrite=False) is None
    assert resolve_resume(tmp_path, "none", overwrite=False) is None


def test_highest_step_and_incomplete_skipped(tmp_path):
    root = tmp_path / "checkpoints"
    fake(root, "step_2")
    fake(root, "step_9")
    fake(root, "step_10")
    fake(root, "step_11", complete=False)  # .metadata or meta.json missing: never chosen
    fake(root, "step_12.tmp")  # a save in progress or crashed: never chosen
    fake(root, "step_13.del")  # a prune in progress
    broken = fake(root, "step_14")
    (broken / "meta.json").write_text("{not json")
    assert [p.name for p in list_checkpoints(root)] == ["step_2", "step_9", "step_10"]
    assert find_latest(tmp_path) == root / "step_10"  # numeric, not lexical
    assert find_latest(root) == root / "step_10"  # the checkpoints dir itself works too


def test_most_recent_save_wins(tmp_path):
    root = tmp_path / "checkpoints"
    # crash after step_2's rename, before the pointer update: step_2 is complete and newer
    fake(root, "step_1", saved=100.0)
    fake(root, "step_2", saved=200.0)
    (root / "latest").write_text("step_1\n")
    assert find_latest(tmp_path) == root / "step_2"
    # resumed from step_1 (resume=PATH) and saved step_2 again later than an old step_5
    fake(root, "step_5", saved=150.0)
    assert find_latest(tmp_path) == root / "step_2"
    fake(root, "step_3", saved=300.0)
    assert find_latest(tmp_path) == root / "step_3"


def test_resolve_auto_none_overwrite(tmp_path):
    root = tmp_path / "checkpoints"
    fake(root, "step_3")
    assert resolve_resume(tmp_path, "auto", overwrite=False) == root / "step_3"
    with pytest.raises(ConfigError, match="overwrite=true") as e:
        resolve_resume(tmp_path, "none", overwrite=False)
    assert "resume=auto" in str(e.value) and "step_3" in str(e.value)
    assert resolve_resume(tmp_path, "none", overwrite=True) is None
    assert resolve_resume(tmp_path, None, overwrite=True) is None


def test_resolve_path(tmp_path):
    run = tmp_path / "run"
    ck = fake(run / "checkpoints", "step_5")
    assert resolve_resume(tmp_path / "other", str(ck), overwrite=False) == ck.resolve()
    assert resolve_resume(tmp_path / "other", str(run), overwrite=False) == ck.resolve()
    with pytest.raises(ConfigError, match="no such file"):
        resolve_resume(run, str(tmp_path / "missing"), overwrite=False)
    tmpdir = fake(run / "checkpoints", "step_6.tmp", complete=False)
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        resolve_resume(run, str(tmpdir), overwrite=False)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="relax-convert"):
        resolve_resume(run, str(hf), overwrite=False)
    with pytest.raises(ConfigError, match="empty"):
        resolve_resume(run, " ", overwrite=False)


def test_clear_checkpoints(tmp_path):
    fake(tmp_path / "checkpoints", "step_1")
    clear_checkpoints(tmp_path)
    assert not (tmp_path / "checkpoints").exists() and find_latest(tmp_path) is None
    clear_checkpoints(tmp_path)  # nothing there: no error


def test_a_restart_resumes_from_a_checkpoint_its_metrics_log_reaches(tmp_path):
    """step_N is saved before the row of step N-1 is logged: a trainer killed in between left
    step_4 with rows 0-2 only (the chaos suite's frozen trainer). Resuming at step_4 would lose
    row 3 for good; step_2 re-runs steps 2 and 3."""
    root = tmp_path / "checkpoints"
    fake(root, "step_2", saved=1.0)
    fake(root, "step_4", saved=2.0)
    metrics = tmp_path / "metrics.jsonl"
    assert resume_for_attempt(tmp_path, "auto", False, attempt=1).name == "step_4"  # no log
    metrics.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(3)))
    assert resume_for_attempt(tmp_path, "auto", False, attempt=1).name == "step_2"
    metrics.write_text(metrics.read_text() + json.dumps({"step": 3}) + "\n" + '{"st')  # torn
    assert resume_for_attempt(tmp_path, "auto", False, attempt=1).name == "step_4"
    # only checkpoints ahead of the log: the latest, as before
    metrics.write_text(json.dumps({"step": 0}) + "\n")
    assert resume_for_attempt(tmp_path, "auto", False, attempt=1).name == "step_4"
