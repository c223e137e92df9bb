"""The code runs on the oldest Python that setup.cfg's python_requires lets pip install it on.
Clusters' system Pythons are often older than the 3.11 the suite runs on (Ubuntu 22.04's is
3.10), and nothing else here would see a 3.11-only name: `from typing import Self` in the
broker (broker/flat.py) installed fine on 3.10 and failed at the broker's first import. vermin
reads every module for the language features and standard-library names it uses, with
annotations read as if evaluated (the configs' and reports' are, by get_type_hints)."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys

from tests.conftest import REPO


def oldest_python() -> str:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    requires = cfg["options"]["python_requires"]
    match = re.fullmatch(r">=\s*(3\.\d+)", requires.strip())
    assert match, f"python_requires = {requires}: expected >=3.N"
    return match.group(1)


def test_nothing_needs_a_newer_python_than_python_requires_allows():
    oldest = oldest_python()
    vermin = "import sys; from vermin import main; sys.exit(main())"  # no `python -m vermin`
    r = subprocess.run([sys.executable, "-c", vermin, f"--target={oldest}-", "--no-tips",
                        "--violations", "--eval-annotations", "--processes=1",
                        "relax_slurm", "tools", "tests"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"needs a Python newer than {oldest}:\n{r.stdout[-4000:]}"
