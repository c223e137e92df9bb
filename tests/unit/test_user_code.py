"""The user's own reward or environment named in the config (relax_slurm/user_code.py):
`module:attr` and `file.py:attr` load in the roles (the reward also in the reward pool's own
processes), and the launchers refuse a name that cannot load before any role starts, without
running the user's code. A misspelt `reward.name=my_rewards:my_rewrd` used to start every role
and then fail in the rollout worker; `reward.name=./my_rewards.py:fn` (verl's
custom_reward_function.path) failed there with a TypeError about relative imports."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import textwrap

import pytest

from relax_slurm import user_code
from relax_slurm.config import TrainConfig
from relax_slurm.config.cluster import ContainerConfig, SlurmClusterConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.env import EnvConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.reward import RewardConfig
from relax_slurm.envs.base import EnvError
from relax_slurm.envs.registry import env_factory
from relax_slurm.errors import ConfigError
from relax_slurm.launch.inputs import check_user_code
from relax_slurm.rewards import RewardInput, RewardPool, build_reward
from tests.conftest import REPO, run_env, tiny_command

REWARDS = textwrap.dedent("""
    import os
    from relax_slurm.rewards import RewardInput

    open(os.environ.get("USER_CODE_RAN", os.devnull), "w").close()

    def exact(inp: RewardInput) -> float:
        return float(inp.response.strip() == str(inp.label).strip())

    def pid(inp: RewardInput) -> float:
        return float(os.getpid())

    class Rules:
        @staticmethod
        def half(inp):
            return 0.5

    try:
        from math import inf as LATE
    except ImportError:
        pass
""")

ENV = textwrap.dedent("""
    from relax_slurm.envs.arith_feedback import ArithFeedbackEnv

    def make(max_tries=1):
        return ArithFeedbackEnv(max_tries=max_tries)
""")

INP = RewardInput(prompt="3+4=", response="7", label="7", finish_reason="stop")


@pytest.fixture
def files(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "my_env.py").write_text(ENV)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in ("sub", "sub.my_rewards", "my_env"):  # imported by name from this tmp_path
        sys.modules.pop(name, None)


def test_a_file_path_loads_in_this_process_and_in_the_reward_pools(files):
    score = build_reward(RewardConfig(name="sub/my_rewards.py:exact"))
    assert score(INP) == 1.0
    assert build_reward(RewardConfig(name="./sub/my_rewards.py:Rules.half"))(INP) == 0.5
    again = pickle.loads(pickle.dumps(score))  # what a worker process is sent
    assert again(INP) == 1.0
    name = f"{files}/sub/my_rewards.py:pid"

    async def in_the_pool():
        async with RewardPool(1, timeout_s=30.0, warm_up=False) as pool:
            return await pool.score(name, INP), await pool.score(score, INP)

    (pid, error), exact = asyncio.run(in_the_pool())
    assert not error and pid > 0 and exact == (1.0, False)


def test_an_environment_from_a_file_or_a_module(files, monkeypatch):
    monkeypatch.syspath_prepend(str(files))  # a role's `python -m` puts its directory first
    for name in ("my_env.py:make", "my_env:make"):
        env = env_factory(name, {"max_tries": 2})()
        assert type(env).__name__ == "ArithFeedbackEnv"
    with pytest.raises(EnvError, match=r"my_env\.py has no 'mak'"):
        env_factory("my_env.py:mak")


@pytest.mark.parametrize("value,message", [
    ("sub/my_rewards.py:exakt",
     r"my_rewards\.py defines no 'exakt' at its top level \(it defines Rules, exact, pid\)"),
    ("sub/nope.py:exact", r"no file .*sub/nope\.py"),
    ("no_such_module_x:fn", r"no module 'no_such_module_x' here.*path/to/file\.py:name"),
    ("sub.my_rewards:exakt", r"defines no 'exakt'"),  # sub/ is a namespace package of cwd
    ("broken:fn", r"broken\.py does not parse: .* \(line 2\)"),
    (":fn", r"give package\.module:name or path/to/file\.py:name"),
])
def test_the_launch_check_refuses_what_cannot_load_without_running_it(
        files, monkeypatch, value, message):
    (files / "broken.py").write_text("def fn(inp):\n    return (\n")
    monkeypatch.setenv("USER_CODE_RAN", str(files / "ran"))
    with pytest.raises(ConfigError, match=r"reward\.name=.*" + message):
        user_code.locate(value, "reward.name")
    for good in ("sub/my_rewards.py:exact", "sub.my_rewards:Rules.half", "sub/my_rewards.py:LATE"):
        user_code.locate(good, "reward.name")
    assert not (files / "ran").exists()  # the user's module never ran


def test_names_a_module_may_bind_in_ways_the_check_cannot_see_are_let_through(files):
    (files / "star.py").write_text("from math import *\n")
    (files / "lazy.py").write_text("def __getattr__(name):\n    return len\n")
    user_code.locate("star.py:sqrt", "reward.name")
    user_code.locate("lazy.py:anything", "reward.name")


def _cfg(reward: str, env: str | None = None, **cluster) -> TrainConfig:
    return TrainConfig(run_dir="r", model=ModelConfig(path="m"), data=DataConfig(train_files=["d"]),
                       reward=RewardConfig(name=reward), env=EnvConfig(name=env),
                       **({"cluster": SlurmClusterConfig(**cluster)} if cluster else {}))


def test_relative_files_are_kept_absolute_and_images_are_not_searched(files):
    cfg = _cfg("sub/my_rewards.py:exact", "my_env.py:make")
    check_user_code(cfg)
    assert cfg.reward.name == f"{files}/sub/my_rewards.py:exact"  # config.yaml names it so
    assert cfg.env.name == f"{files}/my_env.py:make"
    assert _cfg("exact_match").reward.name == "exact_match"  # registered names untouched
    # the roles import from the image, which the launcher cannot read: paths only
    cfg = _cfg("in_image.py:fn", "pkg_in_image:Env", container=ContainerConfig(image="img.sqsh"))
    check_user_code(cfg)
    assert cfg.reward.name == f"{files}/in_image.py:fn" and cfg.env.name == "pkg_in_image:Env"
    with pytest.raises(ConfigError, match="env.name='pkg_in_image:Env'"):
        check_user_code(_cfg("exact_match", "pkg_in_image:Env"))


def test_relax_train_refuses_a_misspelt_reward_before_anything_starts(tmp_path, tiny_assets):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    run = tmp_path / "run"
    r = subprocess.run([*tiny_command(run, tiny_assets), "reward.name=my_rewards:exakt"],
                       cwd=tmp_path, env=run_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert (f"reward.name='my_rewards:exakt': {tmp_path}/my_rewards.py defines no 'exakt' at "
            "its top level (it defines Rules, exact, pid)") in r.stderr, r.stderr[-3000:]
    assert not (run / "logs").exists()  # nothing was started
