"""rollout=sglang on a machine without GPUs (docs/engines.md#sglang-on-cpu): the engines' command
line (their own python, SGLang's CPU engine and flags), what the launcher settles before the run
(engine_device=auto, the venv's python, the one notice about seeds), and the SGLang settings
refused at config time. The real engines run in tests/integration/test_sglang_cpu_e2e.py."""

from __future__ import annotations

import shlex

import pytest

from relax_slurm.engines import sglang_cpu
from relax_slurm.errors import ConfigError
from relax_slurm.launch import inputs
from relax_slurm.launch.compose import compose_config
from relax_slurm.launch.local import local_plan
from relax_slurm.launch.roles import engine_specs
from relax_slurm.runtime.ports import SGLANG_LOW, draw_range

VENV_PY = "/venvs/sglang/bin/python"


def cfg(*overrides: str):
    return compose_config(["experiment=tiny_cpu", "rollout=sglang", *overrides])


def server_argv(spec) -> list[str]:
    """The engine's argv, the `bash -c 'exec ... --api-key "$KEY"'` wrapper unwrapped."""
    argv = spec.argv
    if argv[:2] == ["bash", "-c"]:
        argv = shlex.split(argv[2].removeprefix("exec "))
    return argv


def test_cpu_engines_run_sglang_from_their_python_with_the_cpu_engine_and_flags():
    c = cfg("rollout.engine_device=cpu", f"rollout.engine_python={VENV_PY}",
            "cluster.rollout_cpus=[1]")
    [spec] = engine_specs(c, local_plan(c))
    argv = server_argv(spec)
    # the CPU engine, and no crash diagnostics: they sleep 5 s at every stop (sglang_cpu)
    assert argv[:8] == ["env", "SGLANG_VLM_CACHE_SIZE_MB=0", "SGLANG_USE_CPU_ENGINE=1",
                        "SGLANG_PYSPY_DUMP_BEFORE_CRASH=false",
                        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH=false", VENV_PY, "-m",
                        "sglang.launch_server"]
    flags = " ".join(argv)
    assert " ".join(sglang_cpu.CPU_FLAGS) in flags
    assert "--base-gpu-id" not in argv and argv[argv.index("--tp-size") + 1] == "1"
    assert spec.cpus == [1]  # pinned like an hf engine
    assert spec.restart_argv == spec.argv  # restarted from the same python


def test_each_engine_gets_a_reserved_port_for_sglangs_own_store():
    """--nccl-port: SGLang's scheduler binds a torch.distributed store port a few seconds into
    its start; left to itself SGLang draws it where our reservations cannot see it (0.5.22+:
    22000-29999; earlier: its HTTP port + 100..1000, inside our range), and a clean run lost
    an SGLang server to a port race (docs/development.md, session 37). Each engine's comes from
    runtime/ports.py like every other port: below SGLang's range, distinct, and reserved."""
    c = cfg("rollout.engine_device=cpu", f"rollout.engine_python={VENV_PY}",
            "rollout.num_engines=3")
    specs = engine_specs(c, local_plan(c))
    argvs = [server_argv(s) for s in specs]
    stores = [int(a[a.index("--nccl-port") + 1]) for a in argvs]
    https = [int(a[a.index("--port") + 1]) for a in argvs]
    lo, hi = draw_range()
    assert all(lo <= p < hi <= SGLANG_LOW for p in stores)
    assert len(set(stores + https)) == 6  # no two alike, none an engine's HTTP port
    assert all(s.restart_argv == s.argv for s in specs)  # a restart binds the same ones


def test_gpu_engines_keep_the_launchers_python_and_their_gpu():
    c = cfg("rollout.engine_device=cuda")
    [spec] = engine_specs(c, local_plan(c))
    argv = server_argv(spec)
    assert argv[:2] == ["env", "SGLANG_VLM_CACHE_SIZE_MB=0"]  # sglang_api.RL_ENV
    assert argv[3:5] == ["-m", "sglang.launch_server"] and "--device" not in argv
    assert "--base-gpu-id" in argv and spec.cpus is None


def test_the_launcher_settles_the_device_and_says_once_that_seeds_are_ignored(capsys,
                                                                            monkeypatch):
    monkeypatch.setattr(inputs, "gpu_visible", lambda: False)
    c = cfg(f"rollout.engine_python={VENV_PY}")
    assert c.rollout.engine_device == "auto"
    inputs.prepare_sglang_engines(c)
    assert (c.rollout.engine_device, c.rollout.engine_python) == ("cpu", VENV_PY)
    err = capsys.readouterr().err
    assert err.count("SGLang ignores every sampling_seed") == 1
    monkeypatch.setattr(inputs, "gpu_visible", lambda: True)
    det = cfg("rollout.deterministic=true")
    inputs.prepare_sglang_engines(det)
    assert (det.rollout.engine_device, det.rollout.engine_python) == ("cuda", None)
    assert "sampling_seed" not in capsys.readouterr().err
    hf = compose_config(["experiment=tiny_cpu"])
    inputs.prepare_sglang_engines(hf)
    assert hf.rollout.engine_device == "auto" and capsys.readouterr().err == ""


def test_cpu_engines_without_a_python_get_the_projects_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_SGLANG_CPU_HOME", str(tmp_path))
    monkeypatch.setattr(sglang_cpu, "_steps", lambda python, constraints: [])  # no pip here
    c = cfg("rollout.engine_device=cpu", "rollout.deterministic=true")
    inputs.prepare_sglang_engines(c)
    assert c.rollout.engine_python == str(sglang_cpu.venv_python(tmp_path))
    assert sglang_cpu.is_current(tmp_path)


@pytest.mark.parametrize("args", [["--pp-size", "2"], ["--dp-size=2"],
                                  ["--data-parallel-size", "4"],
                                  ["--pipeline-parallel-size", "2"]])
def test_pipeline_or_data_parallel_engines_are_refused(args):
    with pytest.raises(ConfigError, match="one tensor-parallel group.*rollout.num_engines"):
        cfg(f"rollout.engine_extra_args=[{','.join(repr(a) for a in args)}]")


def test_parallel_sizes_of_one_and_other_flags_pass():
    c = cfg("rollout.engine_extra_args=[--dp-size,1,--context-length,64]")
    assert c.rollout.engine_extra_args[-1] == "64"


def test_sglang_flags_are_refused_with_the_hf_engine():
    """They used to be dropped without a word (rollout.engine=hf launches no SGLang)."""
    with pytest.raises(ConfigError, match=r"engine_extra_args=\['--context-length', '64'\]"
                       r".*rollout.engine='hf' takes none.*rollout=sglang"):
        compose_config(["experiment=tiny_cpu", "rollout.engine_extra_args=[--context-length,64]"])


def test_weight_checksums_are_refused_with_sglang_engines():
    with pytest.raises(ConfigError, match="weight_sync.verify=false with rollout.engine=sglang"):
        cfg("weight_sync.verify=true")
    assert compose_config(["experiment=tiny_cpu", "weight_sync.verify=true"]).weight_sync.verify


def test_cpu_engines_are_one_process_each():
    with pytest.raises(ConfigError, match="engine_tp_size=1"):
        cfg("rollout.engine_device=cpu", "rollout.engine_tp_size=2")
    with pytest.raises(ConfigError, match="use auto, cuda or cpu"):
        cfg("rollout.engine_device=tpu")
