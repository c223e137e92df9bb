"""A wheel of relax-slurm carries its Hydra configs: installed (not editable) into a fresh venv,
`relax-train` composes the presets from any directory (and, bare, names them), and a user's own
config directory is added with --config-dir."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the package's sources (the checkout stays untouched)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("relax_slurm", "conf"):
        shutil.copytree(REPO / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", str(src), "--wheel-dir", str(out)],
                   check=True, timeout=300)
    [whl] = out.glob("relax_slurm-*.whl")
    return whl


def test_the_wheel_carries_every_config(wheel):
    packaged = {n.removeprefix("relax_slurm/") for n in zipfile.ZipFile(wheel).namelist()
                if n.startswith("relax_slurm/conf/")}
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml")}
    assert packaged == on_disk


def test_the_wheel_carries_the_sglang_cpu_shims(wheel):
    # an installed relax-sglang-cpu copies them into the CPU SGLang venv (engines/sglang_cpu)
    shims = REPO / "relax_slurm" / "engines" / "sglang_cpu" / "shims"
    on_disk = {str(p.relative_to(REPO)) for p in shims.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    packaged = {n for n in zipfile.ZipFile(wheel).namelist()
                if n.startswith("relax_slurm/engines/sglang_cpu/shims/")}
    assert packaged == on_disk and len(on_disk) == 3


def test_an_installed_wheel_composes_from_anywhere(wheel, tmp_path):
    # nothing of a checkout on the path (a clean-clone run sets PYTHONPATH to the clone)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"
    # A plain venv that sees this interpreter's packages the way a user's would see the ones
    # pip installs: through a .pth file naming this interpreter's site-packages (not
    # --system-site-packages, which is the base Python's and misses a venv's packages: the
    # README's commands run in one). Paths named in a .pth file get no .pth processing of
    # their own, so this interpreter's editable relax-slurm stays out.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    [purelib] = (venv / "lib").glob("python3*/site-packages")
    (purelib / "_outer_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # with its dependencies, as a user installs it: pip resolves every requirement the wheel
    # declares against what is on the path (a missing or conflicting one fails here)
    subprocess.run([venv / "bin" / "pip", "install", "--quiet", str(wheel)],
                   check=True, timeout=300)
    where = subprocess.run([venv / "bin" / "python", "-c",
                            "import relax_slurm; print(relax_slurm.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True, env=env).stdout
    assert where.startswith(str(venv)), where  # the installed copy, not the checkout

    def job(*args: str) -> str:
        proc = subprocess.run([venv / "bin" / "relax-train", *args, "run_dir=r", "--cfg", "job"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    assert "total_steps: 150" in job("experiment=tiny_cpu")
    # bare: the usage and the presets, not 100 steps of the base config that learn nothing
    bare = subprocess.run([venv / "bin" / "relax-train"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    assert bare.returncode == 2 and "usage: relax-train experiment=NAME" in bare.stderr
    assert "tiny_cpu" in bare.stderr and not (tmp_path / "runs").exists()
    mine = tmp_path / "mine" / "experiment"
    mine.mkdir(parents=True)
    (mine / "short.yaml").write_text("# @package _global_\ndefaults:\n  - tiny_cpu\n"
                                     "trainer:\n  total_steps: 7\n")
    assert "total_steps: 7" in job("--config-dir", str(tmp_path / "mine"), "experiment=short")
