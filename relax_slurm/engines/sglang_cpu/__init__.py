"""The real SGLang server on a machine without GPUs: a venv of its own, built by the project.

SGLang pins its own transformers and tokenizers and declares a CUDA torch, so it lives apart
from the project's environment: `relax-sglang-cpu install` (or the first `rollout=sglang` run on
a CPU machine) builds ~/.cache/relax_slurm/sglang-cpu-<SGLANG_VERSION>/venv with

- torch==TORCH_VERSION as pip resolves it here (the CPU build, as the README's install takes);
- sglang==SGLANG_VERSION without its dependencies, then REQUIREMENTS (its declared ones minus
  the CUDA-only ones and those the text path never imports), all under the constraint
  torch==TORCH_VERSION so that nothing replaces the CPU torch;
- NO_DEPS: the real triton (imported at module level everywhere, never run on CPU),
  torchvision (a CUDA build, made importable by the shim below) and xgrammar, without deps;
- the shims of shims/ in its site-packages: `sgl_kernel`, a pure-torch stand-in for the CPU
  sgl-kernel (not on PyPI), and `relax_sglang_cpu_shim` (+ its .pth), which lets SGLang's
  code paths start without CUDA: the torchvision and sgl_kernel operator schemas a CPU torch
  cannot register, host memory unpinned, the routed-experts (R3) host cache unregistered;
  it also lets every process of the venv keep the bytecode it compiles;
- pip installs without byte-compiling (PIP_FLAGS); the last step compiles what a server
  imports (WARM_IMPORTS).

The venv is rebuilt when this recipe or a shim changes (STAMP holds their hash), built in a
temporary folder and renamed into place, under a file lock so that two processes asking at once
build it once. Engines run as `VENV/bin/python -m sglang.launch_server` with SERVER_ENV and
CPU_FLAGS (relax_slurm/engines/sglang_api.py server_argv).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from relax_slurm.errors import EngineError

SGLANG_VERSION = "0.5.23"
"""The SGLang release the CPU venv holds: the newest of sglang_api.TESTED_SGLANG."""
TORCH_VERSION = "2.13.0"
"""SGLang 0.5.22+ declare torch 2.14.1, published only as a CUDA build; 2.13.0 (the project's
CPU torch) serves everything relax-slurm uses."""
REQUIREMENTS = (
    "aiohttp", "anthropic>=0.20.0", "apache-tvm-ffi==0.1.11", "blobfile==3.0.0", "build",
    "compressed-tensors==0.18.0", "datasets", "distro", "easydict", "einops", "fastapi", "gguf",
    "interegular", "IPython", "llguidance>=1.7.6,<2.0.0", "mistral_common>=1.11.5", "modelscope",
    "msgspec", "ninja", "numpy", "nvidia-ml-py", "openai==2.8.0", "openai-harmony==0.0.4",
    "orjson", "packaging", "partial_json_parser", "pillow", "prometheus-client>=0.20.0", "psutil",
    "py-spy", "pybase64", "pydantic", "python-dateutil<3", "python-multipart", "pyzmq>=25.1.2",
    "regex", "requests", "scipy", "sentencepiece==0.2.1", "setproctitle",
    "smg-grpc-servicer>=0.9.0", "soundfile==0.13.1", "tiktoken", "tokenizers==0.23.2", "tqdm",
    "transformers==5.19.0", "uvicorn>=0.51", "uvloop", "watchfiles", "xxhash", "zstandard",
)
"""sglang 0.5.23's Requires-Dist without the CUDA-only packages (cuda-python, flashinfer,
flash-attn-4, nvidia-*, sgl-kernel, torch_memory_saver, ...) and those the text path never
imports (kernels, numba, outlines, timm, torchaudio, torchcodec, ...)."""
NO_DEPS = ("triton==3.8.0", "torchvision==0.28.0", "xgrammar==0.2.7")
"""Installed without dependencies: each would otherwise replace the CPU torch."""
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "false",
              "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "false"}
"""SGLANG_USE_CPU_ENGINE selects SGLang's CPU platform (is_cpu()), and turns the torchvision
shim on. The other two: a run's stop SIGTERMs the engine's whole session, so SGLang's server
sees its scheduler die and takes it for a crash, whose diagnostics (a CUDA coredump, py-spy
stacks of the schedulers) first sleep 5 s "to let GPU activity settle": 5 s of every CPU
engine's stop, restart and test teardown for nothing (no CUDA; the schedulers are gone by then;
`relax-ctl dump` takes a live engine's stacks)."""
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--skip-server-warmup", "--max-total-tokens", "16384", "--sleep-on-idle")
"""Without --max-total-tokens the KV pool takes ~72% of free RAM and start-up crawls; without
--sleep-on-idle the idle scheduler busy-polls a whole core; the warm-up request is skipped
because the launcher's own /health wait follows."""
PIP_FLAGS = ("--disable-pip-version-check", "--no-input", "--no-compile")
"""--no-compile: pip would byte-compile all ~27,000 files of the venv (~100 CPU-s on 2 cores,
most of the build's CPU), of which a server imports ~7,000. The build's last step compiles
those by importing WARM_IMPORTS, and the venv's processes keep the bytecode of anything else
they import (shims/relax_sglang_cpu_shim.py)."""
WARM_IMPORTS = (
    "sglang.launch_server", "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.registry",
)
"""Imported once by the build, as a server runs (SERVER_ENV), to compile what a server and
its scheduler import: the HTTP server, the managers, the model runner and the model registry,
which imports every architecture SGLang has (a server does, to find its model's). Measured
(session 55): ~6,900 modules; a server's start compiles ~90 more (uvicorn's protocols, gRPC
stubs), once."""
SHIMS = Path(__file__).parent / "shims"
STAMP = "relax-sglang-cpu.stamp"


def cache_root() -> Path:
    """RELAX_SGLANG_CPU_HOME, else ~/.cache/relax_slurm (where the project caches)."""
    env = os.environ.get("RELAX_SGLANG_CPU_HOME")
    return Path(env) if env else Path.home() / ".cache" / "relax_slurm"


def venv_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / f"sglang-cpu-{SGLANG_VERSION}" / "venv"


def venv_python(root: Path | None = None) -> Path:
    return venv_dir(root) / "bin" / "python"


def shim_files() -> list[Path]:
    return sorted(p for p in SHIMS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def recipe_hash() -> str:
    """What the venv is built from: versions, package lists, the base Python and every shim's
    bytes. A venv whose stamp holds another hash is rebuilt."""
    h = hashlib.sha256()
    for part in (SGLANG_VERSION, TORCH_VERSION, *REQUIREMENTS, *NO_DEPS, *PIP_FLAGS,
                 *WARM_IMPORTS,
                 f"{sys.version_info.major}.{sys.version_info.minor}"):
        h.update(part.encode() + b"\0")
    for path in shim_files():
        h.update(path.relative_to(SHIMS).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def is_current(root: Path | None = None) -> bool:
    stamp = venv_dir(root) / STAMP
    return stamp.is_file() and stamp.read_text().strip() == recipe_hash()


def _steps(python: Path, constraints: Path) -> list[tuple[str, list[str]]]:
    """After the venv and its shims: the pip installs, then the bytecode of what a server
    imports (the shim lets that process write it whatever PYTHONDONTWRITEBYTECODE says; a
    .pyc names its source by mtime and size, not by path, so the rename into place keeps it
    valid)."""
    pip = [str(python), "-m", "pip", "install", *PIP_FLAGS]
    return [
        (f"pip install torch=={TORCH_VERSION}", [*pip, f"torch=={TORCH_VERSION}"]),
        (f"pip install sglang=={SGLANG_VERSION} (no deps)",
         [*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"]),
        (f"pip install its {len(REQUIREMENTS)} requirements",
         [*pip, "-c", str(constraints), *REQUIREMENTS]),
        ("pip install " + " ".join(NO_DEPS) + " (no deps)", [*pip, "--no-deps", *NO_DEPS]),
        ("the bytecode of what a server imports",
         ["env", *(f"{k}={v}" for k, v in SERVER_ENV.items()), str(python), "-c",
          f"import {', '.join(WARM_IMPORTS)}"]),
    ]


def _run(cmd: list[str], log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                               stdin=subprocess.DEVNULL)
    if code:
        tail = log.read_text(errors="replace")[-3000:]
        raise EngineError(f"building the CPU SGLang venv failed: {' '.join(cmd)} exited with "
                          f"{code} (full log: {log}):\n{tail}")


def _site_packages(python: Path) -> Path:
    out = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True)
    return Path(out.strip())


def _build(final: Path, say: Callable[[str], None]) -> None:
    """Build the venv in a folder beside `final` and rename it into place (the caller holds
    the lock)."""
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    log = final.parent / "build.log"
    log.write_text(f"building {final} (recipe {recipe_hash()})\n")
    t0 = time.monotonic()
    try:
        python = tmp / "bin" / "python"
        constraints = tmp / "constraints.txt"
        steps = _steps(python, constraints)
        say(f"relax-sglang-cpu: [1/{len(steps) + 2}] python -m venv ({sys.executable})")
        _run([sys.executable, "-m", "venv", str(tmp)], log)
        constraints.write_text(f"torch=={TORCH_VERSION}\n")
        say(f"relax-sglang-cpu: [2/{len(steps) + 2}] the shims")
        site = _site_packages(python)
        for path in shim_files():
            dest = site / path.relative_to(SHIMS)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
        for i, (what, cmd) in enumerate(steps, start=3):
            say(f"relax-sglang-cpu: [{i}/{len(steps) + 2}] {what} "
                f"({time.monotonic() - t0:.0f} s)")
            _run(cmd, log)
        (tmp / STAMP).write_text(recipe_hash() + "\n")
        if final.exists():  # an older recipe's venv: out of the way first, then removed
            old = final.with_name(f"{final.name}.old-{os.getpid()}")
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"relax-sglang-cpu: SGLang {SGLANG_VERSION} for CPU is ready in {final} "
        f"({time.monotonic() - t0:.0f} s)")


def ensure_venv(root: Path | None = None, say: Callable[[str], None] = print) -> Path:
    """The CPU SGLang venv's python, built first if it is missing or out of date (minutes,
    once). Safe when several processes ask at once: one builds, the others wait for it."""
    final = venv_dir(root)
    if is_current(root):
        return final / "bin" / "python"
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"relax-sglang-cpu: another process is building {final}: waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_current(root):  # nobody built it while we waited
            say(f"relax-sglang-cpu: building SGLang {SGLANG_VERSION} for CPU in {final} "
                "(pip, a few minutes; once)")
            _build(final, say)
    return final / "bin" / "python"
