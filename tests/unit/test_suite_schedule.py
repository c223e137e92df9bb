"""The suite's schedule holds: each test file is one unit of work for pytest-xdist
(tests/conftest.py marks every test with its file's xdist_group; setup.cfg: --dist loadgroup),
so a file's module fixtures (an undisturbed reference run, a set of torchrun layouts, an
SGLang server) are made once, on one worker.

pytest 9.2 keeps a node's id in `_id`, and pytest-xdist 3.8 writes the group into `_nodeid`:
the group was lost without a word, every test became its own unit, and each worker ran its own
copy of every module fixture (a clean-clone run of session 25 took both workers through every
integration file). setup.cfg pins pytest below 9.2; this fails if a release breaks it again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TEST_FILE = """
import json, os
def _note(name):
    with open(os.environ["SCHEDULE_OUT"], "a") as f:
        f.write(json.dumps([__name__, name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
""" + "".join(f"def test_{i}():\n    _note('{i}')\n" for i in range(6))


def test_each_test_file_runs_on_one_xdist_worker(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", tests / "conftest.py")
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (tests / name).write_text(TEST_FILE)
    out = tmp_path / "schedule.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(REPO / "setup.cfg"), "--rootdir", str(tmp_path), "-o", "addopts=",
         "-n", "2", "--dist", "loadgroup", "--import-mode=importlib", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SCHEDULE_OUT": str(out),
             "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for module, _, worker in map(json.loads, out.read_text().splitlines()):
        workers.setdefault(module, set()).add(worker)
    assert len(workers) == 3 and all(len(w) == 1 for w in workers.values()), workers


def test_every_module_has_current_bytecode_before_the_tests_start():
    """tests/conftest.py's pytest_configure compiles the package before any test starts a
    process: with PYTHONDONTWRITEBYTECODE set (this machine's and CI's environment) nothing
    else writes a relax_slurm `.pyc` (an editable install gets none from pip), and each of the
    suite's role processes compiled every module it imports from source again. A timestamp
    `.pyc` records its source's mtime and size (bytes 8-16); Python uses it only when both
    match."""
    import importlib.util
    import struct

    stale = []
    for source in sorted((REPO / "relax_slurm").rglob("*.py")):
        cached = Path(importlib.util.cache_from_source(str(source)))
        st = source.stat()
        header = cached.read_bytes()[:16] if cached.is_file() else b""
        if (len(header) < 16 or struct.unpack("<I", header[4:8])[0] != 0
                or struct.unpack("<II", header[8:16]) != (int(st.st_mtime) & 0xFFFFFFFF,
                                                          st.st_size & 0xFFFFFFFF)):
            stale.append(str(source.relative_to(REPO)))
    assert not stale, f"{len(stale)} modules without current bytecode, e.g. {stale[:5]}"
