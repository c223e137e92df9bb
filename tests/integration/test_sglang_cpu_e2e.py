"""The tiny task learned through the real SGLang server (issue #33): `relax-train
experiment=tiny_cpu rollout=sglang` on a machine without GPUs starts SGLang 0.5.23's own
`sglang.launch_server` from the project's CPU venv (docs/engines.md#sglang-on-cpu), pushes the
weights into it over a gloo weight-update group inside SGLang's update sessions, and the reward
rises as it does on the hf engine."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from relax_slurm.engines import sglang_cpu
from tests.conftest import (ONE_RANK, REPO, relax_train, run_env, stopped_on_reward, tiny_command,
                            until_reward)
from tests.integration.test_lora_e2e import adapter_bytes
from tests.integration.test_tiny_e2e import read_rows

RUN_TIMEOUT_S = 900
# The 3-step mean reward first reaches 0.3 at steps 33-44 on SGLang (run seeds 0, 1, 2) and at
# 36-42 on the hf engine (the same seeds, one rank): 90 steps is ~2x the slowest, the bound the
# runs are held to; each ends once it gets there (tests/conftest.py until_reward). 0.8 is no
# claim for a short run: in 150 steps SGLang reaches it at seed 2 (step 68) and not at seeds 0
# and 1 (plateaus near 0.6 and 0.7), as the hf engine does at seed 0 (step 63) and not at seeds
# 1 and 2 (0.71, 0.75): the preset's 0.8 depends on the run seed on both engines.
STEPS, REWARD_LAST = 90, 0.3
# At algo.max_staleness=1 the same 0.3 is first reached at steps 36, 55, 36 (seeds 0, 1, 2;
# 0.8 at 74 and 67 for seeds 0 and 2, not in 90 steps for seed 1): 110 steps is 2x the slowest.
ASYNC_STEPS = 110


def process_group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (an engine role is its own session: SGLang's
    scheduler and detokenizer children stay in it)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def run_on_sglang(run_dir: Path, tiny: Path, steps: int, *overrides: str) -> dict:
    proc = relax_train(run_dir, tiny, "rollout=sglang", ONE_RANK, f"trainer.total_steps={steps}",
                       *overrides, timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # said once, at launch: SGLang without --enable-deterministic-inference ignores the seeds
    assert proc.stderr.count("SGLang ignores every sampling_seed") == 1
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow  # the venv's build on a fresh machine
@pytest.mark.timeout(600)
def test_the_venv_holds_the_bytecode_of_what_a_server_imports(sglang_cpu_python):
    """pip's byte-compiling of all ~27,000 files of the venv was most of its build's CPU
    (~100 CPU-s on 2 cores) and a server imports ~7,000 of them: the build installs without it,
    then compiles what a server imports (sglang_cpu.WARM_IMPORTS), and the venv's processes
    keep any other module's bytecode even where PYTHONDONTWRITEBYTECODE is set (CI, many
    images), or every server start would compile those modules again."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.check_output(
        [str(sglang_cpu_python), "-c", "import sys, sysconfig; "
         "print(sys.dont_write_bytecode, sysconfig.get_paths()['purelib'])"],
        env={**env, "PYTHONDONTWRITEBYTECODE": "1"}, text=True).split()
    assert out[0] == "False", out
    site = Path(out[1])
    for module in sglang_cpu.WARM_IMPORTS:
        source = site.joinpath(*module.split(".")).with_suffix(".py")
        assert Path(importlib.util.cache_from_source(str(source))).is_file(), module
    sources, compiled = (sum(1 for _ in site.rglob(pattern)) for pattern in ("*.py", "*.pyc"))
    assert sources > 20_000 and compiled < sources / 2, (sources, compiled)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 300)  # + the venv's build on a fresh machine
def test_tiny_sync_learns_on_real_sglang_sharing_the_trainers_memory(tmp_path, tiny_assets,
                                                                   sglang_cpu_python):
    """Also the shared-GPU schedule on real SGLang (issue #33 item 3), as the hf engine's sync
    run does (test_tiny_e2e.py): the engine sleeps while the trainer steps and takes every push
    through /update_weights_from_tensor (shared memory on CPU, CUDA IPC handles on GPUs, where
    NCCL refuses a group of two ranks on one GPU). The weight-update group's pushes
    (/update_weights_from_distributed) are the async run's below."""
    run_dir = tmp_path / "sglang_sync"
    summary = run_on_sglang(run_dir, tiny_assets, STEPS, "algo.max_staleness=0",
                            "rollout.release_memory_during_train=true", *until_reward(REWARD_LAST))
    rows = read_rows(run_dir)
    steps = stopped_on_reward(summary, [r["rollout/reward_mean"] for r in rows])
    # the engine was SGLang's own server, from the venv the launcher found (built by the
    # fixture through the same code path), recorded for restarts
    rollout = yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]
    assert (rollout["engine_device"], rollout["engine_python"]) == ("cpu",
                                                                    str(sglang_cpu_python))
    engine_log = (run_dir / "logs" / "engine0.log").read_text()
    assert "server_args=" in engine_log and "'device': 'cpu'" in engine_log  # SGLang's own
    for route, count in (("release_memory_occupation", steps),
                         ("resume_memory_occupation", steps),
                         ("update_weights_from_tensor", steps + 1)):  # one bucket
        assert engine_log.count(f'POST /{route} HTTP/1.1" 200') == count, route
    assert "update_weights_from_distributed" not in engine_log
    assert "weight sync by reference" in (run_dir / "logs" / "trainer.log").read_text()
    assert [r["policy/version"] for r in rows] == list(range(1, steps + 1))
    assert max(r["broker/staleness_max"] for r in rows) == 0
    # every push arrived whole: SGLang's log-probs are the trainer's on the pushed weights
    # (float32 rounding apart)
    assert max(r["train/rollout_train_logprob_diff"] for r in rows) < 1e-4
    assert summary["reward_first"] <= 0.05  # measured 0.005-0.02
    assert summary["reward_last"] >= REWARD_LAST, [round(r["rollout/reward_mean"], 3)
                                                   for r in rows]
    # every process of the engine went with the run: server, scheduler, detokenizer; and the
    # trainer's shared-memory manager (torch's, started for the first push) with the trainer
    for name in ("engine0", "trainer"):
        role = next(r for r in json.loads((run_dir / "roles.json").read_text())
                    if r["name"] == name)
        assert process_group_members(role["pid"]) == [], name


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_tiny_async_learns_on_real_sglang_within_staleness_one(tmp_path, tiny_assets,
                                                               sglang_cpu_python):
    # rollout runs one version ahead: every push pauses SGLang in retract mode (the running
    # requests go back to its queue and continue on the new weights), so samples span two
    # versions (meta_info.weight_versions, as SGLang reports them)
    run_dir = tmp_path / "sglang_async"
    summary = run_on_sglang(run_dir, tiny_assets, ASYNC_STEPS, "algo.max_staleness=1",
                            *until_reward(REWARD_LAST))
    rows = read_rows(run_dir)
    steps = stopped_on_reward(summary, [r["rollout/reward_mean"] for r in rows])
    assert {r["broker/staleness_max"] for r in rows} == {0, 1}  # ran ahead, within the bound
    # a group whose oldest tokens fell two versions behind (a retract can carry a sequence
    # over a push) is dropped whole by the broker's rule, its credit given back: 0, 16, 0, 16
    # and 112 samples in five runs (112 with another run beside it); nothing is lost
    assert summary["samples_dropped_stale"] % 16 == 0 and summary["samples_lost"] == 0
    assert max(r["rollout/multi_version_frac"] for r in rows) > 0
    engine_log = (run_dir / "logs" / "engine0.log").read_text()
    for route in ("pause_generation", "update_weights_from_distributed", "continue_generation"):
        assert engine_log.count(f'POST /{route} HTTP/1.1" 200') == steps + 1, route
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "gloo" in trainer_log and "rank 0 + 1 engines" in trainer_log  # the group's pushes
    assert summary["reward_first"] <= 0.05
    assert summary["reward_last"] >= REWARD_LAST, [round(r["rollout/reward_mean"], 3)
                                                   for r in rows]


# model.lora.rank=8 (docs/lora.md) at algo.max_staleness=1, bounds on the mean reward of the
# first and the last 5 of 22 steps. SGLang samples unseeded, so every run is another draw.
# Measured (first 5 / last 5): 0.006 / 0.130, 0.004 / 0.148, 0.006 / 0.142 (25-step runs,
# session 28), 0.004 / 0.156, and once 0.0035 / 0.020 (session 29's clean run: a stall, the
# entropy fell to 2.3 with the reward at 0.014-0.029 from step 10). 0.01 is half that stall,
# above every untrained 5-step mean (0.0035-0.006), which a sync that never
# reached the engine would keep; 22 steps keep the run near SGLang's start-up time (~46 s).
LORA_STEPS, LORA_FIRST, LORA_LAST = 22, 0.02, 0.01


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_tiny_lora_learns_on_real_sglang_with_async_adapter_only_syncs(tmp_path, tiny_assets,
                                                                       sglang_cpu_python):
    """`relax-train experiment=tiny_cpu model.lora.rank=8 rollout=sglang algo.max_staleness=1`:
    every sync loads the adapter by SGLang's own routes under its version's name while
    generation goes on, nothing goes by the full-weight route, and the adapter two versions
    back is unloaded after each sync (engines/served_adapter.py); every sample comes from one
    adapter whose version is within the bound; the engine's log-probs are the trainer's on the
    adapter; the short run learns."""
    run_dir = tmp_path / "sglang_lora"
    # at lr 1e-2, the measured one: the quickest start (the preset's 3e-3 suits 150 steps)
    summary = run_on_sglang(run_dir, tiny_assets, LORA_STEPS, "model.lora.rank=8",
                            "model.lora.lr=1e-2", "algo.max_staleness=1")
    engine_log = (run_dir / "logs" / "engine0.log").read_text()
    assert "'enable_lora': True" in engine_log  # SGLang's own server_args line
    # one sync before step 0 and one after each step; none pauses generation (a request names
    # a version whose adapter is loaded whole)
    syncs = LORA_STEPS + 1
    for route, count in (("load_lora_adapter_from_tensors", syncs),
                         ("update_weight_version", syncs)):
        assert engine_log.count(f'POST /{route} HTTP/1.1" 200') == count, route
    assert "POST /pause_generation" not in engine_log
    # version v's sync unloads v - 2 after it, in the background: versions 0 .. LORA_STEPS-2,
    # each found, in order; the last may not have finished when the run ended
    unloaded = [int(v) for v in re.findall(r"Start unload Lora adapter\. Lora name=policy-v(\d+)",
                                           engine_log)]
    assert unloaded in (list(range(syncs - 2)), list(range(syncs - 3))), unloaded
    assert engine_log.count('POST /unload_lora_adapter HTTP/1.1" 200') >= syncs - 3
    assert 'POST /unload_lora_adapter HTTP/1.1" 400' not in engine_log
    assert "update_weights_from_distributed" not in engine_log
    rows = read_rows(run_dir)
    lora = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["lora"]
    # the adapter's bytes alone, every sync (68,160 on the tiny model; full weights: 301,056)
    assert {r["weight_sync/bytes"] for r in rows} == {
        adapter_bytes(tiny_assets / "model", 8, lora["target_modules"])}
    assert [r["policy/version"] for r in rows] == list(range(1, LORA_STEPS + 1))
    # within the bound; a request names one adapter, so no sample spans two versions (the
    # full-weight async run's retracted requests do)
    assert {r["broker/staleness_max"] for r in rows} <= {0, 1}
    assert max(r["rollout/multi_version_frac"] for r in rows) == 0
    assert summary["samples_lost"] == 0
    # the trainer's log-probs are the engine's where the samples are of the trained version
    # (step 0; after it the samples are a version behind: the diff is one step's change).
    # SGLang's torch_native LoRA against PEFT with a nonzero adapter: test_engine_contract.py
    on_policy = [r for r in rows if r["broker/staleness_max"] == 0]
    assert on_policy and max(r["train/rollout_train_logprob_diff"] for r in on_policy) < 1e-5
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first <= LORA_FIRST and last >= LORA_LAST, [round(x, 3) for x in rewards]
    assert summary["reward_first"] <= 0.05


AGENT_STEPS = 12


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_multi_turn_episodes_distill_an_sglang_teacher(tmp_path, tiny_assets,
                                                       sglang_cpu_python):
    """`experiment=tiny_agent_cpu rollout=sglang` with a teacher: multi-turn episodes (each
    turn a /generate of the whole context so far, observations included) on SGLang policy
    engines, every episode's model tokens scored by an SGLang teacher's prefill; the student
    approaches the teacher as on the hf engine (test_agent_e2e.py)."""
    from tests.integration.test_algos_e2e import make_teacher

    teacher = make_teacher(tiny_assets, tmp_path / "teacher")
    run_dir = tmp_path / "agent_opd"
    cmd = tiny_command(run_dir, tiny_assets, "rollout=sglang", f"trainer.total_steps={AGENT_STEPS}",
                       "metrics.progress=false", f"algo.teacher_model_path={teacher}",
                       experiment="tiny_agent_cpu")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for role in ("engine0", "teacher"):  # both SGLang's own server
        assert "server_args=" in (run_dir / "logs" / f"{role}.log").read_text(), role
    rows = read_rows(run_dir)
    assert len(rows) == AGENT_STEPS and all(r["rollout/turns_mean"] >= 1 for r in rows)
    assert max(r["rollout/turns_mean"] for r in rows) > 1  # episodes of several turns
    # every turn's tokens were sampled by the pushed weights (float32 rounding apart)
    assert max(r["train/rollout_train_logprob_diff"] for r in rows) < 1e-4
    kl = [r["train/opd_reverse_kl"] for r in rows]
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert last < 0.75 * first, (first, last)


# the run ends once the 3-step mean reward reaches KILL_REWARD after the kill, within 50 steps
KILL_STEPS, KILL_AT, KILL_REWARD = 50, 10, 0.15


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_a_killed_sglang_engine_is_replaced_and_resynced_while_the_trainer_waits(
        tmp_path, tiny_assets, sglang_cpu_python):
    """SIGKILL of the engine's whole process tree mid-run, async, pushes in abort mode (the
    aborted sequences continue from their prefixes: partial rollouts on SGLang's answers): the
    launcher restarts it in
    place (SGLang starts again from model.path, version 0), and the trainer re-forms the
    cohort and sends the current weights (from its batch wait, or after a push that met the
    dead engine failed). Before the fix the push of the
    previous version, ended but not yet joined (overlap), kept the re-sync from running for the
    whole wait: the restarted engine generated at version 0, every sample was dropped as
    stale, and the run stalled until trainer.get_batch_timeout_s (here 180 s: a failure, not a
    10-minute hang)."""
    run_dir = tmp_path / "sglang_kill"
    cmd = tiny_command(run_dir, tiny_assets, "rollout=sglang", ONE_RANK, "metrics.progress=false",
                       f"trainer.total_steps={KILL_STEPS}", "algo.max_staleness=1",
                       *until_reward(KILL_REWARD),
                       "weight_sync.pause_mode=abort", "trainer.get_batch_timeout_s=180")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=run_env(), start_new_session=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + RUN_TIMEOUT_S
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= KILL_AT):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        engine = next(r for r in json.loads((run_dir / "roles.json").read_text())
                      if r["name"] == "engine0")
        os.killpg(engine["pid"], signal.SIGKILL)  # server, scheduler, detokenizer
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert "engine0 exited with code -9; restarted in place" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_rows(run_dir)
    steps = stopped_on_reward(summary, [r["rollout/reward_mean"] for r in rows])
    assert steps > KILL_AT and summary["samples_lost"] == 0, summary
    assert summary["restarts"] == {"engine0": 1}, summary
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    # found by a version check in the batch wait, or by a push that met the dead engine
    # (the kill's timing decides; the stall was the first, the common case)
    assert ("serve another version" in trainer_log or "weight sync failed" in trainer_log) \
        and "weight-sync cohort 1 formed" in trainer_log, trainer_log[-3000:]
    assert [r["step"] for r in rows] == list(range(steps))
    # abort mode: SGLang ends the running requests at each push with the tokens they had; the
    # worker continues each from its prefix on the new weights (rollout.partial_rollout)
    assert max(r["rollout/resumed_frac"] for r in rows) > 0
    assert max(r["rollout/multi_version_frac"] for r in rows) > 0
    assert summary["reward_first"] <= 0.05
    # the point is the recovery; the run still learns (0.41 at step 40 in the run that found
    # the stall, and 0.3 is reached at steps 36-55 without a kill): half of that
    assert summary["reward_last"] >= KILL_REWARD
