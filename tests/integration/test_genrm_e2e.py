"""A managed judge (reward.genrm_model_path) end to end: relax-train serves it as role `genrm`,
the rewards come from it, and a judge killed mid-run is restarted in place while the run goes on.

The judge is the tiny model rewired to answer "1" to anything (embeddings all alike, layers
silent, only "1"'s row in an untied lm_head): with `genrm_parser=exact_one` and one new token
every reward is 1.0 if, and only if, the judge answered it (the tiny task's own exact_match
reward starts near 0.01, and a judge that failed would count a reward error).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from relax_slurm.metrics.jsonl import iter_metrics
from tests.conftest import ONE_RANK, REPO, run_env, tiny_command

TIMEOUT_S = 900
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * TIMEOUT_S)]


def make_judge(tiny: Path, out: Path) -> Path:
    """The tiny model, made to answer "1" greedily whatever the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    model.config.tie_word_embeddings = False
    judge = type(model)(model.config)
    judge.load_state_dict(model.state_dict(), strict=False)
    one = tokenizer.convert_tokens_to_ids("1")
    with torch.no_grad():
        judge.model.embed_tokens.weight.fill_(1.0)  # every token the same vector ...
        for layer in judge.model.layers:  # ... left as it is by every layer's residual ...
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        judge.lm_head.weight.zero_()  # ... and read as "1" alone
        judge.lm_head.weight[one] = 1.0
    judge.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def judge(tiny_assets, tmp_path_factory) -> Path:
    return make_judge(tiny_assets, tmp_path_factory.mktemp("judge") / "model")


def judged(judge: Path, steps: int) -> tuple[str, ...]:
    # a short judge prompt and one new token; a generous judge timeout so that a judge being
    # restarted (seconds to import torch and load on a busy machine) is waited for
    return (ONE_RANK, "metrics.progress=false", f"trainer.total_steps={steps}",
            "reward.name=genrm", f"reward.genrm_model_path={judge}", "reward.genrm_parser=exact_one",
            "reward.genrm_template='{prompt}{response}={label}'",
            "reward.genrm_max_new_tokens=1", "reward.genrm_timeout_s=300", "reward.timeout_s=300",
            "rollout.batch_size=8", "rollout.groups_per_request=8")


def start(run_dir: Path, tiny: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(tiny_command(run_dir, tiny, *overrides), cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=run_env(),
                            start_new_session=True)


def finish(proc: subprocess.Popen) -> str:
    """Wait for the run's end; kill what is left of it (its whole session) either way."""
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    return err


def metrics(run_dir: Path) -> list[dict]:
    # the rows written so far: a line being written is not read yet (read while the run runs)
    return list(iter_metrics(run_dir / "metrics.jsonl"))


def assert_judged(run_dir: Path, steps: int) -> None:
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    assert sum(r["rollout/reward_errors"] for r in rows) == 0
    assert all(r["rollout/reward_mean"] == 1.0 for r in rows), [r["rollout/reward_mean"]
                                                                 for r in rows]


def test_rewards_come_from_the_managed_judge_restarted_in_place_when_killed(tmp_path,
                                                                          tiny_assets, judge):
    steps, run_dir = 8, tmp_path / "run"
    proc = start(run_dir, tiny_assets, *judged(judge, steps))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(metrics(run_dir)) < 2:  # mid-run: the judge has answered two steps
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        pid = next(r["pid"] for r in json.loads((run_dir / "roles.json").read_text())
                   if r["name"] == "genrm")
        os.kill(pid, signal.SIGKILL)
        err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "genrm exited with code -9; restarted in place" in err, err[-4000:]
    rows = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [(r["role"], r["kind"]) for r in rows] == [("genrm", "in_place")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["restarts"] == {"genrm": 1}, summary
    new_pid = next(r["pid"] for r in json.loads((run_dir / "roles.json").read_text())
                   if r["name"] == "genrm")
    assert new_pid != pid
    assert_judged(run_dir, steps)  # no reward lost: the calls waited for the new judge
    roles = json.loads((run_dir / "roles.json").read_text())
    assert {r["name"] for r in roles} == {"broker", "engine0", "genrm", "rollout", "trainer"}
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["genrm_url"] and plan["genrm_url"] not in plan["engine_urls"]
