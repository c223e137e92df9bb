"""Partial rollouts against a real hf engine and a real weight sync (scripts/partial_rollout.py):
a group the sync aborts mid-way (weight_sync.pause_mode=abort) is continued from its prefix by
the rollout worker; its samples record the versions of their tokens, and the broker's staleness
rule judges the oldest."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import run_script  # noqa: E402

ROWS, MAX_NEW = 4, 300


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_aborted_group_continues_from_its_prefix_and_records_both_versions(tmp_path):
    r = run_script("partial_rollout.py", tmp_path)
    assert all(r["multi_version"]), r  # the sync landed mid-way (retried up to 3 times)
    old = r["attempt"]  # attempt i syncs version i -> i + 1
    for spans in r["spans"]:
        # the old version's tokens, then the new one's: one cut, the whole budget in the end
        [[v0, a0, b0], [v1, a1, b1]] = spans
        assert (v0, v1) == (old, old + 1) and a0 == 0 and 0 < b0 == a1 < b1 == MAX_NEW
    assert r["versions"] == [[old, old + 1]] * ROWS
    assert r["lengths"] == [[MAX_NEW, MAX_NEW]] * ROWS and r["finish"] == ["length"] * ROWS
    # the prefix is what the old weights drew (a straight run with the same seeds), the rest
    # what the new weights draw from prompt + prefix with the derived seeds; each comparison
    # repeats the same rows in the same batch shape on the same weights: the same float32
    # computation, so no tolerance
    assert r["prefix_same_tokens"] and r["prefix_logprob_gap"] == 0.0
    assert r["rest_same_tokens"] and r["rest_logprob_gap"] == 0.0
    assert r["rest_versions"] == [str(old + 1)]
    assert r["wire_spans_equal"]
    # max_staleness=1: taken at the newest version (staleness 1, judged by the oldest), dropped
    # one version later, where its newest version alone would still have passed
    assert r["staleness"][str(old + 1)] == {"taken": True, "dropped": 0, "staleness_max": 1}
    assert r["staleness"][str(old + 2)] == {"taken": False, "dropped": 1, "staleness_max": None}
