"""Shared fixtures: the tiny model and data, built once per session by the real tools."""

from __future__ import annotations

import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Runs that do not test data parallelism train on one rank: on 2 cores a second rank costs ~15
# CPU-s of start-up and ~20% of each step's CPU. The preset's own runs (test_tiny_e2e.py), exact
# resume and the global restart keep its two ranks.
ONE_RANK = "trainer.nproc_per_node=1"
NEEDS_MEGATRON = pytest.mark.skipif(
    importlib.util.find_spec("megatron.bridge") is None,
    reason="megatron-bridge not installed: pip install --no-deps megatron-bridge==0.3.1 "
           "(see docs/backends.md)")
"""The megatron tests' marker: they skip, naming the install command, without the bridge."""


def until_reward(reward: float, steps: int = 3) -> tuple[str, str]:
    """A learning run's end: trainer.stop_at (trainer/stop_at.py) stops it at the first step
    whose last `steps` rewards average at least `reward`. Its trainer.total_steps stays the
    bound the test asserts (2x the slowest crossing measured); a run pays for the crossing it
    makes, not for the bound."""
    return f"trainer.stop_at.reward={reward}", f"trainer.stop_at.steps={steps}"


def stopped_on_reward(summary: dict, rewards: list[float]) -> int:
    """The step a run given `until_reward` ended at, asserting it ended on its reward target:
    stopped by it before trainer.total_steps, or (nothing left to stop) reaching it at its
    last step, which summary.json's `stop_at.reached_at_step` records (the rewards of every
    step in the failure's message)."""
    early = summary.get("stopped_early")
    if early is None:
        reached = (summary.get("stop_at") or {}).get("reached_at_step")
        assert reached is not None and reached == summary["steps"], (
            summary, [round(r, 3) for r in rewards])
        return reached
    assert early["reason"].startswith("trainer.stop_at.reward="), (
        summary, [round(r, 3) for r in rewards])
    assert summary["steps"] == early["at_step"] < early["total_steps"], summary
    return early["at_step"]


def tiny_command(run_dir: Path, tiny: Path, *overrides: str, experiment: str = "tiny_cpu"
                 ) -> list[str]:
    """`relax-train experiment=tiny_cpu` (or another tiny experiment) on the session's tiny
    model and data."""
    return [sys.executable, "-m", "relax_slurm.launch.cli", f"experiment={experiment}",
            f"run_dir={run_dir}", f"model.path={tiny / 'model'}",
            f"data.train_files=[{tiny / 'arith_train.jsonl'}]", *overrides]


def run_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def relax_train(run_dir: Path, tiny: Path, *overrides: str, timeout_s: float = 900
                ) -> subprocess.CompletedProcess:
    """Run the tiny experiment to its end (the real launcher and process topology)."""
    return subprocess.run(tiny_command(run_dir, tiny, *overrides), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, env=run_env())


def run_tool(script: str, *args: str) -> None:
    """`python tools/SCRIPT ARGS` in this process: the script's own `main` (each of
    tools/make_tiny_model.py, prepare_data.py, prepare_mm_data.py is `sys.exit(main(argv))` of
    the relax_slurm.tiny module it imports). A Python of its own would import torch and
    transformers again: ~5 CPU-s a model, against ~0.5 s here, for the same bytes (the builds
    are seeded; checked with cmp). tests/unit/test_tools.py runs the scripts as a user does."""
    main = runpy.run_path(str(REPO / "tools" / script))["main"]
    assert main(list(args)) == 0, (script, args)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """`tools/make_tiny_model.py` + `tools/prepare_data.py` output: DIR/model, DIR/arith_*.jsonl."""
    out = tmp_path_factory.mktemp("tiny")
    run_tool("make_tiny_model.py", "--out", str(out / "model"))
    run_tool("prepare_data.py", "--out", str(out))
    return out


@pytest.fixture(scope="session")
def tiny_mm_assets(tmp_path_factory) -> Path:
    """The multimodal tiny models and tasks: DIR/vl_model (Qwen2.5-VL), DIR/vl3_model (Qwen3-VL),
    DIR/audio_model
    (Qwen2-Audio), DIR/colors_*.jsonl + DIR/colors/*.png, DIR/change_*.jsonl + DIR/change/*.mp4,
    DIR/tones_*.jsonl + DIR/tones/*.wav."""
    out = tmp_path_factory.mktemp("tiny_mm")
    for kind in ("vl", "vl3", "audio"):
        run_tool("make_tiny_model.py", "--out", str(out / f"{kind}_model"), "--kind", kind)
    for task in ("colors", "change", "tones"):
        run_tool("prepare_mm_data.py", "--out", str(out), "--task", task)
    return out


@pytest.fixture(scope="session")
def sglang_cpu_python() -> Path:
    """The real SGLang for CPU (relax-sglang-cpu install): its venv's python, built by the
    launcher's own code path when missing or out of date (about 1.5 min from PyPI, then
    cached in ~/.cache/relax_slurm), so a fresh machine runs these tests too. On a fresh
    machine the build started at collection (below) is usually done by now; if not, its
    file lock makes this wait for it instead of building twice."""
    from relax_slurm.engines import sglang_cpu

    return sglang_cpu.ensure_venv()


def pytest_configure(config) -> None:
    """Compile the package to bytecode once, before any test starts a process. Where
    PYTHONDONTWRITEBYTECODE is set (this machine's and CI's environment; many container images
    set it too) no process writes its `.pyc`, and an editable install has none from pip, so
    each of the suite's ~700 role processes (launcher, broker, worker, engines, ranks) compiled
    every relax_slurm module it imports from source again: 0.1-0.3 CPU-s a process, ~0.8 of a
    tiny run's ~19 (PYTHONPROFILEIMPORTTIME in each role's log). Python reads `.pyc` files
    whatever that variable says, and recompiles any whose source is newer."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # the controller, before its workers
        import compileall
        import py_compile

        for tree in ("relax_slurm", "tools", "tests"):  # timestamps even under SOURCE_DATE_EPOCH
            if (REPO / tree).is_dir():  # not in test_suite_schedule's copy of this conftest
                compileall.compile_dir(REPO / tree, quiet=1, workers=1,
                                       invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)


_sglang_build: subprocess.Popen | None = None


# first: pytest-xdist's own hook reads the xdist_group marks to make the units of work
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_work_unit(item)))
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":
        _start_sglang_build(items)


def _work_unit(item) -> str:
    """What one pytest-xdist worker runs as a whole (setup.cfg: -n 2 --dist loadgroup): a test
    file, so that its module fixtures (an undisturbed reference run, a set of torchrun
    layouts) are made once; every tests/slurm test together, since they share one single-node
    cluster whose CPUs two jobs at once would have to queue for."""
    path = Path(str(item.path)).resolve().relative_to(REPO)
    return "slurm" if path.parts[:2] == ("tests", "slurm") else str(path)


def _start_sglang_build(items) -> None:
    """Start building the CPU SGLang venv in the background as soon as the tests that need it
    are collected, when it is missing (a fresh machine, CI's empty HOME): the build is mostly
    pip waiting on downloads and disk, and it overlaps the tests that run before the first
    SGLang one instead of adding its ~1.5 min to the suite. Under xdist the first worker
    starts it; any other that needs it waits on the build's file lock."""
    global _sglang_build
    if not any("sglang_cpu_python" in getattr(item, "fixturenames", ())
               or item.get_closest_marker("sglang_cpu") for item in items):
        return
    from relax_slurm.engines import sglang_cpu

    if sglang_cpu.is_current():
        return
    sglang_cpu.cache_root().mkdir(parents=True, exist_ok=True)
    log = open(sglang_cpu.cache_root() / "prebuild.log", "w")
    _sglang_build = subprocess.Popen(
        [sys.executable, "-m", "relax_slurm.engines.sglang_cpu", "install"], stdout=log,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()


def pytest_sessionfinish(session, exitstatus) -> None:
    """A build still running when the tests end (-x, -k without SGLang tests) is interrupted:
    SIGINT, so that it removes its half-built folder (relax_slurm/engines/sglang_cpu)."""
    if _sglang_build is not None and _sglang_build.poll() is None:
        import signal

        os.killpg(_sglang_build.pid, signal.SIGINT)
        try:
            _sglang_build.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(_sglang_build.pid, signal.SIGKILL)
            _sglang_build.wait()
