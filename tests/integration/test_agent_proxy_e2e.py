"""experiment=tiny_proxy_cpu end to end: an external program (tools/arith_agent.py, plain OpenAI
HTTP) plays the tiny game through the rollout worker's proxy while the real topology trains on
its sessions. Asserts the steps happen with gradients, the trainer's log-probs of the agent's
tokens match the engine's, and the trained samples are the agent's conversations
(debug.dump_rollouts: the trainer's own view of each sample); no learning claim."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_env, tiny_command

STEPS = 3
SPECIAL = re.compile(r"<eos>|<pad>|<unk>")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_external_agent_drives_training_through_the_proxy(tmp_path, tiny_assets):
    run_dir, record = tmp_path / "proxy", tmp_path / "sessions.jsonl"
    cmd = tiny_command(run_dir, tiny_assets, f"trainer.total_steps={STEPS}",
                       "metrics.progress=false", "debug.dump_rollouts=true", "rollout.batch_size=4",
                       experiment="tiny_proxy_cpu")
    launcher = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    agent = None
    try:
        agent = subprocess.Popen(  # it finds the proxy and its key in the run directory
            [sys.executable, "tools/arith_agent.py", "--run-dir", str(run_dir), "--n", "4",
             "--data", str(tiny_assets / "arith_train.jsonl"), "--record", str(record),
             # partial credit for a number: the untrained model rarely answers right, and all-0
             # rewards would give the trainer nothing to learn from
             "--number-bonus", "0.1"],
            cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = launcher.communicate(timeout=800)
        assert launcher.returncode == 0, out[-3000:]
        assert agent.wait(timeout=120) == 0, agent.communicate()[0][-3000:]
    finally:
        for proc in (agent, launcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the trainer scores the agent's tokens as the engine did (token in == token out) ...
    assert all(m["train/rollout_train_logprob_diff"] < 1e-3 for m in metrics), metrics
    # ... and learns from them (the sessions' rewards differ)
    assert any(m["train/grad_norm"] > 0 for m in metrics), metrics
    played = [json.loads(x) for x in record.read_text().splitlines()]
    texts = {}  # group -> (prompt, the conversation after it, reward) of each of its sessions
    for s in played:
        turns = [r + (s["observations"][k] if k < len(s["observations"]) else "")
                 for k, r in enumerate(s["replies"])]
        texts.setdefault(s["group"], []).append((s["prompt"], "".join(turns), s["reward"]))
    rows = [json.loads(x) for f in sorted((run_dir / "rollouts").glob("*.jsonl"))
            for x in f.read_text().splitlines()]
    assert len(rows) == STEPS * 4 * 4  # batch_size groups of n sessions per step
    for row in rows:
        # the trainer's sample is one of the agent's conversations, token for token (special
        # tokens aside: the agent sees text), with the reward the agent gave
        assert (SPECIAL.sub("", row["prompt"]), SPECIAL.sub("", row["response"]),
                row["reward"]) in texts[row["prompt_id"]]
