"""An engine restarted in place re-joins the weight sync through a new cohort, and one lost for
good is left (trainer rank 0's side alone, against real hf engine processes; the whole runs
are in test_chaos.py and tests/slurm/test_slurm_elastic.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers_tiny
from helpers_tiny import REPO_ROOT, child_env, make_tiny_model  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_script(name: str, tmp_path: Path) -> dict:
    """scripts/NAME --model-dir (a tiny model) --out F, as a process of its own (it forms
    torch.distributed groups); its JSON findings."""
    model_dir = make_tiny_model(tmp_path / "model")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), "--model-dir", str(model_dir),
                           "--out", str(out)], cwd=REPO_ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_restarted_engine_is_resynced_through_a_new_cohort(tmp_path):
    r = run_script("cohort_rejoin.py", tmp_path)
    url = r["stale_restarted"][0]
    assert r["stale_before"] == [] and r["resync_before"] is False
    assert r["stale_dead"] is None  # unreachable: wait, do not re-form yet
    assert r["stale_restarted"] == [url]  # back at version 0
    assert r["resync_restarted"] is True and r["generation"] == 1
    assert r["stale_after"] == [] and r["verified"] is True
    # the lost engine is left: the cohort re-formed with the survivor and sent it the weights
    assert r["followed"] == [url] and r["verified_after_loss"] is True


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_update_abandoned_midway_gives_way_to_the_next_cohort(tmp_path):
    r = run_script("abandoned_update.py", tmp_path)
    assert r["stuck_done_before"] is False  # the engine waits for the second tensor
    # the next cohort's update goes through at once, not after the engine's 120 s timeout
    assert r["verified"] is True and r["version"] == "2"
    assert r["new_update_s"] < 60, r
    assert "abandoned" in r["stuck_error"], r
