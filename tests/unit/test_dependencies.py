"""Every third-party module the package and its tests import is declared where the README's
commands install it from, so that those commands alone make the suite pass on a fresh machine.

The imports are read from the sources (`ast`: every `import`, also inside functions, and every
`importlib.import_module("literal")`), mapped to the distributions that provide them in this
environment, and each must be declared: the package's own imports in `install_requires`, or,
for the optional pieces imported where they are used, in the extra the table below names; the
tests' imports in `install_requires` or the `dev` extra (the README's test command installs
both, and megatron-bridge by its own `pip install --no-deps`). A dependency that is only pulled
in by another one is not declared: it can vanish with that other one's next release (pillow
came through matplotlib in `dev` only, so `pip install -e .` of the tiny VL preset had no PIL).

What SGLang's sources import for the contract test that parses launch lines with each pinned
release's own parser (orjson, IPython, ...) is not ours to read here: that test runs in a venv
made for the run by `.ci/run` and names the missing module."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata as md
import inspect
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
# installed by the README's commands beside the extras (`pip install --no-deps ...`)
README_EXTRA = {"megatron-bridge"}
# optional pieces of the package, imported only where they are used: {module: extras that
# declare it}; a module here must be declared in each extra named (checked below)
OPTIONAL = {
    "sglang": ("gpu",),
    "transformer_engine": ("gpu",),
    # stubbed on CPU (trainer/megatron/cpu_compat.py); the real one comes with CUDA torch
    "triton": (),
    "megatron": ("gpu", "megatron_cpu"),
    "matplotlib": ("observability",),  # relax-plot
    "apprise": ("observability",),  # notify.urls
    "wandb": ("observability", "wandb"),
    "tensorboard": ("observability",),
    "nltk": ("ifbench",), "langdetect": ("ifbench",), "syllapy": ("ifbench",),
    "emoji": ("ifbench",),
}


def declared() -> dict[str, set[str]]:
    """{'install_requires' | extra: canonical distribution names} from setup.cfg."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")

    def names(text: str) -> set[str]:
        lines = (ln.split("#")[0].strip() for ln in text.splitlines())
        return {canonicalize_name(Requirement(ln).name) for ln in lines if ln}

    out = {"install_requires": names(cfg["options"]["install_requires"])}
    out.update({k: names(v) for k, v in cfg["options.extras_require"].items()})
    return out


OTHER_ENV = REPO / "relax_slurm" / "engines" / "sglang_cpu" / "shims"
"""Files run by another interpreter: the CPU SGLang venv's shims (engines/sglang_cpu), whose
packages its own recipe installs; their torchaudio stand-in defines the module it names."""


def local_modules() -> set[str]:
    """Names a script imports from its own folder (tools/bench/common.py, tests' helpers)."""
    trees = [REPO / d for d in ("relax_slurm", "tests", "tools") if (REPO / d).is_dir()]
    return {p.stem if p.suffix == ".py" else p.name for tree in trees for p in tree.rglob("*")
            if p.suffix == ".py" or p.is_dir()}


def imports(root: str) -> dict[str, set[str]]:
    """{top-level third-party module: files importing it} under REPO/root."""
    own = local_modules() | {"relax_slurm", "tests", "__future__"}
    out: dict[str, set[str]] = {}
    for path in sorted((REPO / root).rglob("*.py")):
        if path.is_relative_to(OTHER_ENV):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module" and node.args
                  and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                mods = [node.args[0].value]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own:
                    out.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return out


def packages_distributions() -> dict[str, list[str]]:
    """{top-level module: distributions}, as Python 3.11's `packages_distributions`: from a
    distribution's top_level.txt, else from the files it installed. Python 3.10's reads
    top_level.txt only, which wheels of newer build backends (numpy's, pyzmq's, orjson's, ...)
    do not have, so on 3.10 they provided nothing."""
    out: dict[str, list[str]] = {}
    for dist in md.distributions():
        declared_tops = (dist.read_text("top_level.txt") or "").split()
        tops = declared_tops or {
            f.parts[0] if len(f.parts) > 1 else inspect.getmodulename(f.name) or f.name
            for f in dist.files or ()}
        for top in tops:
            if "." not in top:
                out.setdefault(top, []).append(dist.metadata["Name"])
    return out


def undeclared(root: str, allowed: set[str]) -> list[str]:
    providers = packages_distributions()
    missing = []
    for mod, files in sorted(imports(root).items()):
        if mod in OPTIONAL:
            continue
        dists = {canonicalize_name(d) for d in providers.get(mod, ())}
        if not dists & allowed:
            where = ", ".join(sorted(files)[:3])
            missing.append(f"{mod} (from {sorted(dists) or 'nothing installed'}; {where})")
    return missing


def test_the_package_declares_what_it_imports():
    deps = declared()
    missing = undeclared("relax_slurm", deps["install_requires"])
    assert not missing, ("imported by relax_slurm/ but not in setup.cfg's install_requires "
                         "(declare it there, or add the module to OPTIONAL with the extra that "
                         f"declares it): {missing}")


def test_the_tests_import_only_what_the_readme_installs():
    deps = declared()
    missing = undeclared("tests", deps["install_requires"] | deps["dev"] | README_EXTRA)
    assert not missing, ("imported by tests/ but installed by none of the README's commands "
                         f"(add it to the dev extra in setup.cfg): {missing}")


def test_every_optional_module_is_declared_in_the_extras_named():
    deps = declared()
    providers = packages_distributions()
    wrong = []
    for mod, extras in OPTIONAL.items():
        for extra in extras:
            dists = {canonicalize_name(d) for d in providers.get(mod, ())}
            if extra not in deps or (dists and not dists & deps[extra]):
                wrong.append(f"{mod} -> [{extra}]")
    assert not wrong, f"OPTIONAL names an extra that does not declare the module: {wrong}"


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    # the scan reads function bodies and import_module literals, where optional pieces live
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    import zmq.asyncio\n"
                              "import importlib\nimportlib.import_module('msgpack')\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert set(imports("pkg")) == {"zmq", "msgpack"}
    assert undeclared("pkg", {"pyzmq"}) == [
        f"msgpack (from ['msgpack']; pkg/m.py)"]


def test_ci_runs_the_readmes_test_command_in_a_venv_of_its_own():
    # the README's second command, verbatim in .ci/run, and it starts by making the venv that
    # every package then comes from (a command run in the machine's Python passes on leftovers)
    readme = (REPO / "README.md").read_text()
    [test_cmd] = [ln for ln in readme.splitlines() if ln.endswith("&& python -m pytest")]
    assert test_cmd.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert test_cmd in (REPO / ".ci" / "run").read_text().splitlines()
    assert "/.venv/" in (REPO / ".gitignore").read_text().splitlines()
