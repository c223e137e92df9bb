"""Group choices and Hydra's output directories on relax-train's command line, checked before
Hydra (whose own error lists its search path and the internal base_* schemas)."""

from __future__ import annotations

import sys

import pytest

from relax_slurm.errors import ConfigError
from relax_slurm.launch import cli
from relax_slurm.launch.choices import check_group_choices, check_hydra_dirs
from relax_slurm.launch.compose import CONF_DIR


def test_a_misspelt_algo_names_the_closest_and_no_internal_schema():
    with pytest.raises(ConfigError) as e:
        check_group_choices(["algo=gpro"], CONF_DIR)
    assert "algo=gpro: no such algo; did you mean grpo?" in str(e.value)
    assert "base_" not in str(e.value) and "grpo" in str(e.value)


def test_an_unknown_experiment_lists_the_presets():
    with pytest.raises(ConfigError, match=r"experiment=nope: no such experiment.*tiny_cpu"):
        check_group_choices(["experiment=nope"], CONF_DIR)


def test_known_choices_sweeps_and_keys_pass():
    check_group_choices(["experiment=tiny_cpu", "algo=grpo,dapo", "+experiment=null",
                         "trainer.lr=1e-5", "algo=choice(grpo,rloo)", "-m"], CONF_DIR)
    with pytest.raises(ConfigError, match="algo=dapx"):
        check_group_choices(["-m", "algo=grpo,dapx"], CONF_DIR)


@pytest.mark.parametrize("arg", ["hydra.run.dir=/tmp/x", "hydra.sweep.dir=/tmp/x",
                                 "+hydra.run.dir=/tmp/x"])
def test_hydra_output_dirs_are_refused_naming_run_dir(arg):
    with pytest.raises(ConfigError, match="write run_dir=/tmp/x instead"):
        check_hydra_dirs([arg])


def test_relax_train_refuses_before_hydra_writes_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # pytest keeps its Ctrl-C
    out = tmp_path / "x"
    monkeypatch.setattr(sys, "argv", ["relax-train", "experiment=tiny_cpu",
                                      f"hydra.run.dir={out}"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 1
    assert f"run_dir={out}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither /tmp/x/.hydra nor runs/<timestamp>
