"""The install recipe for the megatron backend adds up (docs/backends.md, "Installing").

megatron-bridge is installed with --no-deps everywhere (its declared requirements pin
transformers<5 and CUDA 13 wheels); the extras carry what it needs on this project's path. This
checks that no extra pulls the bridge, that every documented command names one bridge version,
and (when the bridge is installed) that each of its declared requirements is either provided by
the package/extras or excluded with a reason in docs/backends.md.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
BRIDGE_LINE = re.compile(r"pip install --no-deps megatron-bridge==([0-9][\w.]*)")
# declared by megatron-bridge 0.3.1, deliberately not installed (the reason is in the docs table)
EXCLUDED = {"transformers", "transformer-engine", "mamba-ssm", "causal-conv1d",
            "flash-linear-attention", "timm", "open-clip-torch", "qwen-vl-utils", "mlflow",
            "nvidia-resiliency-ext"}
WITH_TORCH = {"typing-extensions"}  # a requirement of torch itself


def _names(lines: str) -> set[str]:
    return {Requirement(x).name.lower().replace("_", "-")
            for x in lines.strip().splitlines() if x.strip() and not x.strip().startswith("#")}


def setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def test_no_extra_pulls_megatron_bridge_and_gpu_covers_cpu():
    extras = {k: _names(v) for k, v in setup_cfg()["options.extras_require"].items()}
    for name, reqs in extras.items():
        assert "megatron-bridge" not in reqs, f"extra {name} installs megatron-bridge with deps"
    # the GPU extra has what the CPU one gives the bridge, plus transformer-engine and SGLang
    assert extras["megatron_cpu"] <= extras["gpu"]
    assert {"transformer-engine", "sglang", "megatron-core"} <= extras["gpu"]
    assert extras["megatron_cpu"] <= extras["dev"]  # the tests run the megatron backend
    assert extras["ifbench"] <= extras["dev"]  # and every ifbench checker


def documented_commands() -> dict[str, list[str]]:
    files = [REPO / "README.md", REPO / ".ci" / "run", REPO / "setup.cfg",
             *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "relax_slurm").rglob("*.py")),
             *sorted((REPO / "tests").rglob("test_megatron*.py"))]
    found = {}
    for f in files:
        versions = BRIDGE_LINE.findall(f.read_text())
        if versions:
            found[str(f.relative_to(REPO))] = versions
    return found


def test_every_command_names_one_bridge_version():
    found = documented_commands()
    for must in ("README.md", ".ci/run", "docs/backends.md", "docs/development.md",
                 "docs/slurm.md", "setup.cfg"):
        assert must in found, f"{must} lost the megatron-bridge install line"
    versions = {v for vs in found.values() for v in vs}
    assert len(versions) == 1, found
    gpu = 'pip install -e ".[gpu]" && pip install --no-deps megatron-bridge=='
    for doc in ("README.md", "docs/backends.md", "docs/slurm.md"):
        assert gpu in (REPO / doc).read_text(), doc


def test_bridge_requirements_are_provided_or_excluded_with_a_reason():
    try:
        declared = importlib.metadata.requires("megatron-bridge") or []
        version = importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-bridge not installed: pip install --no-deps megatron-bridge==0.3.1")
    (pinned,) = {v for vs in documented_commands().values() for v in vs}
    assert version == pinned
    cfg = setup_cfg()
    provided = (_names(cfg["options"]["install_requires"])
                | _names(cfg["options.extras_require"]["megatron_cpu"]) | WITH_TORCH | {"torch"})
    runtime = {Requirement(r).name.lower().replace("_", "-") for r in declared
               if "extra ==" not in r}
    assert runtime - provided - EXCLUDED == set(), "a new bridge requirement: provide or exclude it"
    assert EXCLUDED <= runtime, "an exclusion no longer declared: drop it from the list and docs"
    docs = (REPO / "docs" / "backends.md").read_text()
    for name in EXCLUDED:
        assert f"`{name}" in docs, f"docs/backends.md does not say why {name} is not installed"


def _legacy_extra(name: str) -> str:
    """An extra's name as pip compares a requested extra with those a package provides
    (setuptools' safe_extra): an underscore and a hyphen are different names, so
    `x[antlr4_9_3]` of a package providing `antlr4-9-3` installs without it, with a warning."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name).lower()


def test_every_extra_asked_for_on_the_way_down_is_provided():
    # issue #39: `pip install -e .` warned "latex2sympy2-extended 1.11.0 does not provide the
    # extra 'antlr4_9_3'": math-verify[antlr4-9-3] asks its dependency for an extra under the
    # other spelling. Walk what the README's commands install (the package and its dev extra)
    # through every extra requested, as pip does, and find each extra where it is asked for.
    cfg = setup_cfg()
    todo = [Requirement(x) for lines in (cfg["options"]["install_requires"],
                                         cfg["options.extras_require"]["dev"])
            for x in lines.strip().splitlines() if x.strip() and not x.strip().startswith("#")]
    seen, missing = set(), []
    while todo:
        req = todo.pop()
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (a marker, a GPU-only package): nothing to walk
        provided = {_legacy_extra(e) for e in dist.metadata.get_all("Provides-Extra") or []}
        for extra in req.extras:
            if _legacy_extra(extra) not in provided:
                missing.append(f"{req} (asked of {dist.metadata['Name']} {dist.version}, "
                               f"which provides {sorted(provided)})")
        key = (req.name.lower(), frozenset(map(_legacy_extra, req.extras)))
        if key in seen:
            continue
        seen.add(key)
        for line in dist.requires or []:
            sub = Requirement(line)
            env = [{"extra": e} for e in req.extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(e) for e in env):
                todo.append(sub)
    assert not missing, missing
