"""Starting again in a run directory (launch/rerun.py): the config diff, what a resume may
change unasked, the history file, and what relax-train says (pure functions and files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_slurm.config import save_config
from relax_slurm.errors import ConfigError
from relax_slurm.launch.interrupt import resume_command
from relax_slurm.launch.rerun import (
    HISTORY_FILE, check_changes, config_changes, free_on_resume, plan_rerun,
)
from relax_slurm.launch.submit import compose_config


def cfg_for(run_dir: Path, *overrides: str):
    return compose_config(["experiment=tiny_cpu", f"run_dir={run_dir}", *overrides])


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    """What find_latest counts as complete: DCP metadata and meta.json."""
    ckpt = run_dir / "checkpoints" / f"step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "saved_unix": 1.0}))
    return ckpt


def test_changes_are_leaves_present_in_both():
    old = {"trainer": {"lr": 2e-3, "total_steps": 150}, "gone": 1, "data": {"files": ["a"]}}
    new = {"trainer": {"lr": 1e-3, "total_steps": 150}, "added": 2, "data": {"files": ["b"]}}
    assert config_changes(old, new) == {"data.files": (["a"], ["b"]),
                                        "trainer.lr": (2e-3, 1e-3)}


def test_launch_keys_run_length_and_timeouts_are_free_the_rest_refused():
    for key in ("trainer.total_steps", "cluster.partition", "metrics.progress", "run_dir",
                "trainer.save_every", "rollout.request_timeout_s", "resume"):
        assert free_on_resume(key), key
    for key in ("trainer.lr", "algo.max_staleness", "seed", "data.train_files", "model.path"):
        assert not free_on_resume(key), key


def test_refusal_names_each_key_old_and_new_and_the_knob():
    changes = {"trainer.lr": (0.002, 0.001), "algo.max_staleness": (0, 2),
               "trainer.total_steps": (150, 300)}
    with pytest.raises(ConfigError) as e:
        check_changes(changes, step=75, allow=False)
    msg = str(e.value)
    assert "trainer.lr 0.002 -> 0.001" in msg and "algo.max_staleness 0 -> 2" in msg
    assert "total_steps" not in msg and "steps 0-74" in msg and "resume_with_changes=true" in msg
    check_changes(changes, step=75, allow=True)
    check_changes({"trainer.total_steps": (150, 300)}, step=75, allow=False)


def test_refusal_on_a_finished_run_says_nothing_is_left_to_train():
    with pytest.raises(ConfigError) as e:
        check_changes({"trainer.lr": (0.002, 0.001)}, step=150, allow=False, total_steps=150)
    msg = str(e.value)
    assert "this run is complete" in msg and "nothing is left to train" in msg
    assert "would train the rest" not in msg and "trainer.lr 0.002 -> 0.001" in msg


def test_plan_rerun_fresh_resume_refused_allowed_and_complete(tmp_path):
    run = tmp_path / "run"
    first = plan_rerun(cfg_for(run), run)
    assert first.resume_from is None and not first.complete
    assert first.message(cfg_for(run), run) is None
    save_config(cfg_for(run), run / "config.yaml")  # what the launcher writes
    fake_checkpoint(run, 75)

    with pytest.raises(ConfigError, match="trainer.lr 0.002 -> 0.001"):
        plan_rerun(cfg_for(run, "trainer.lr=1e-3"), run)
    same = plan_rerun(cfg_for(run), run)
    assert same.step == 75 and not same.complete and not same.changes
    assert "resuming from" in same.message(cfg_for(run), run)

    cfg = cfg_for(run, "trainer.lr=1e-3", "trainer.total_steps=300", "trainer.lr_decay_steps=null",
                  "resume_with_changes=true")
    changed = plan_rerun(cfg, run)
    text = changed.message(cfg, run)
    assert "trainer.lr 0.002 -> 0.001" in text and "lr_decay_steps=150 keeps" in text, text
    assert "resume_with_changes" not in text  # how it was launched, not what steps ran with
    rows = [json.loads(x) for x in (run / HISTORY_FILE).read_text().splitlines()]
    assert [r["from_step"] for r in rows] == [0, 75]
    assert rows[1]["changes"]["trainer.lr"] == {"old": 0.002, "new": 0.001}

    done = plan_rerun(cfg_for(run, "trainer.total_steps=75"), run)
    assert done.complete and "run complete at step 75" in done.message(cfg_for(run), run)
    assert len((run / HISTORY_FILE).read_text().splitlines()) == 2  # nothing ran, no row
    with pytest.raises(ConfigError, match="complete.*nothing is left to train"):
        plan_rerun(cfg_for(run, "trainer.total_steps=75", "trainer.lr=1e-4"), run)


def test_resume_command_keeps_the_overrides_and_drops_resume_and_overwrite(tmp_path):
    argv = ["experiment=tiny_cpu", "data.train_files=[/d/a b.jsonl]", "resume=none",
            "overwrite=true", "trainer.lr=1e-3"]
    cmd = resume_command(argv, tmp_path)
    assert cmd == ("relax-train experiment=tiny_cpu 'data.train_files=[/d/a b.jsonl]' "
                   f"trainer.lr=1e-3 run_dir={tmp_path}")
    assert resume_command(["experiment=x", "run_dir=runs/a"], tmp_path).endswith("run_dir=runs/a")


def test_a_ready_sbatch_script_on_a_complete_or_changed_run(tmp_path):
    """The driver's compose path (sbatch/*.sbatch) applies the same rules as relax-train."""
    from relax_slurm.launch.slurm_driver import compose_run_dir
    from relax_slurm.launch.slurm_env import SlurmAllocation

    model, data, run = tmp_path / "model", tmp_path / "d.jsonl", tmp_path / "run"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    alloc = SlurmAllocation(job_id="7", het_groups=(("n1",),))
    base = ["experiment=tiny_cpu", f"run_dir={run}", f"model.path={model}",
            f"data.train_files=[{data}]", "trainer.total_steps=4"]
    assert compose_run_dir(base, alloc) == run.resolve()  # a fresh start
    fake_checkpoint(run, 4)
    assert compose_run_dir(base, alloc) is None  # complete: nothing to do
    with pytest.raises(ConfigError, match="algo.max_staleness 0 -> 1"):
        compose_run_dir([*base, "trainer.total_steps=8", "algo.max_staleness=1"], alloc)


def test_submit_follows_the_same_rules(tmp_path, capsys):
    """relax_slurm.submit([...]) refuses a changed resume and submits nothing for a complete
    run, before it asks Slurm for anything."""
    from relax_slurm.launch.submit import submit

    model, data, run = tmp_path / "model", tmp_path / "d.jsonl", tmp_path / "run"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["experiment=tiny_cpu", f"run_dir={run}", f"model.path={model}",
            f"data.train_files=[{data}]", "trainer.total_steps=4"]
    save_config(compose_config(["cluster=slurm", *base]), run / "config.yaml")
    fake_checkpoint(run, 4)
    with pytest.raises(ConfigError, match="trainer.lr 0.002 -> 0.001"):
        submit([*base, "trainer.lr=1e-3"])
    assert submit(base) is None
    assert "run complete at step 4" in capsys.readouterr().err


def test_rl_from_an_sft_checkpoint_is_refused_naming_its_hf_export(tmp_path):
    """resume=<an SFT run's checkpoint> for an RL run would carry the SFT step count, optimizer
    and lr schedule into RL: refused even with resume_with_changes, pointing at model.path."""
    sft_run, rl_run = tmp_path / "sft", tmp_path / "rl"
    save_config(compose_config(["experiment=tiny_sft_cpu", f"run_dir={sft_run}"]),
                sft_run / "config.yaml")
    ckpt = fake_checkpoint(sft_run, 80)
    for extra in ([], ["resume_with_changes=true"]):
        with pytest.raises(ConfigError, match=rf"algo=sft run and this run is algo=grpo.*"
                                              rf"model\.path={sft_run / 'hf' / 'step_80'}"):
            plan_rerun(cfg_for(rl_run, f"resume={ckpt}", *extra), rl_run)
