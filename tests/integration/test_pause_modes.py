"""weight_sync.pause_mode against a real hf engine (scripts/pause_modes.py): what each mode does
to the batch in flight during a weight sync, as SGLang 0.5.21+ does it."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import run_script  # noqa: E402

from relax_slurm.engines import sglang_api  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pause_modes_treat_the_running_batch_as_sglang_does(tmp_path):
    r = run_script("pause_modes.py", tmp_path)
    rows, max_new = 16, 400
    # retract, no update: back to the queue, continued from its tokens, the same draws
    assert r["retracted_status"] == [0, rows]
    assert r["retract_retractions"] == [1] and r["retract_same_tokens"], r
    # the continued rows' log-probs come from one prefill instead of incremental decoding: the
    # same float32 math in another order (tiny model, 400 positions): far below 1e-3
    assert r["retract_logprob_gap"] < 1e-3
    assert all(s == [["0", 0, max_new]] for s in r["retract_spans"])  # one version: one span
    # in_place cannot flush: refused when the group forms, naming the key
    assert r["in_place_error"] and "weight_sync.pause_mode=in_place" in r["in_place_error"]
    # retract across an update: two spans, the old version's tokens then the new one's
    [(old, new)] = r["across_versions"]
    assert new == old + 1 and r["across_lengths"] == [max_new]
    for s in r["across_spans"]:
        assert [v for v, _, _ in s] == [str(old), str(new)]
        assert s[0][1] == 0 and 0 < s[0][2] == s[1][1] < s[1][2] == max_new
    # abort: finish_reason abort (SGLang's shape) with the tokens generated so far
    assert [json.loads(x) for x in r["abort_reasons"]] == [
        {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}]
    assert r["abort_lengths_ok"] and r["abort_after"] == ["length"]
    # in_place forced: the rows count as running, the flush is refused, the weights are in
    assert r["held"] == rows
    assert r["flush_error"] and sglang_api.FLUSH_REFUSED in r["flush_error"]
    assert r["loaded_despite_flush"]
    assert all(len(v) == 2 and v[1] == v[0] + 1 for v in r["held_spans_versions"])
    assert r["recovered_version"][0] == r["recovered_version"][1]
