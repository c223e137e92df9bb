"""Code of the user's that a config names: `reward.name` and `env.name` given as
`package.module:attr` (importable where the roles run: installed, or under the directory the
run was started from, which every role's `python -m` puts first on sys.path) or as
`path/to/file.py:attr` (verl's `custom_reward_function.path`; read by every role, so on a
shared filesystem on Slurm). `attr` may be dotted (`module:Class.method`).

`load` imports and returns the object (in the role that uses it). `locate` is the launchers'
check before anything starts or is queued: without running the user's code it finds the module
or file, parses it, and looks for `attr`'s first name among the top-level definitions, so that
a typo or a syntax error is refused at once, naming the config key, instead of by the rollout
worker after every role has started (or after a Slurm job has waited in the queue).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from relax_slurm.errors import ConfigError


def is_user_code(value: str) -> bool:
    """`module:attr` or `file.py:attr` (a registered name has no colon)."""
    return ":" in value


def split(value: str) -> tuple[str, str]:
    """(module or file, attr)."""
    where, _, attr = value.rpartition(":")
    return where, attr


def _is_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where


def absolute(value: str) -> str:
    """`value` with a relative `file.py` made absolute (against the current directory), so the
    run's config.yaml names the same file for every role, restart and resume."""
    if not is_user_code(value):
        return value
    where, attr = split(value)
    if not _is_file(where) or Path(where).is_absolute():
        return value
    return f"{Path(where).resolve()}:{attr}"


def load(value: str, key: str) -> Any:
    """The object `value` names; ConfigError naming `key` and the fix when it cannot."""
    where, attr = _parts(value, key)
    obj = _load_file(where, value, key) if _is_file(where) else _import(where, value, key)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}={value!r}: {where} has no {attr!r}. Fix: name a "
                              f"function or class defined at its top level{_defined(obj)}")
        obj = getattr(obj, part)
    return obj


def _parts(value: str, key: str) -> tuple[str, str]:
    where, attr = split(value)
    if not where or not attr:
        raise ConfigError(f"{key}={value!r}: give package.module:name or path/to/file.py:name")
    return where, attr


def _source_file(where: str, value: str, key: str) -> Path:
    path = Path(where).resolve()
    if not path.is_file():
        raise ConfigError(f"{key}={value!r}: no file {path}. Fix: a path to a .py file "
                          "(relative to the directory the run starts from, or absolute)")
    return path


def _defined(module: Any) -> str:
    names = sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
                   and getattr(v, "__module__", None) == module.__name__)
    return f" (it defines {', '.join(names)})" if names else ""


def _import(module: str, value: str, key: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{key}={value!r}: cannot import module {module!r} ({e}). Fix: install it, run "
            "from the directory that holds it, add its directory to PYTHONPATH, or name the "
            "file: path/to/file.py:name") from e


def _load_file(where: str, value: str, key: str) -> Any:
    path = _source_file(where, value, key)
    # one module per file and process, under a name that pickles back to it in this process
    name = f"_relax_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def locate(value: str, key: str) -> None:
    """Refuse `value` (ConfigError naming `key`) when its module or file cannot be found, does
    not parse, or defines no `attr` at its top level; runs none of the user's code but the
    `__init__` of the packages above a dotted module (what finding it takes)."""
    where, attr = _parts(value, key)
    if _is_file(where):
        source = _source_file(where, value, key)
    else:
        source = _find(where, value, key)
        if source is None:  # a compiled or namespace module: found, and not read here
            return
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except SyntaxError as e:
        raise ConfigError(f"{key}={value!r}: {source} does not parse: {e.msg} (line "
                          f"{e.lineno}). Fix the file") from None
    names, defs, star = _top_level_names(tree)
    first = attr.split(".")[0]
    if first not in names and not star:
        defined = ", ".join(sorted(n for n in defs if not n.startswith("_")))
        raise ConfigError(f"{key}={value!r}: {source} defines no {first!r} at its top level"
                          + (f" (it defines {defined})" if defined else "")
                          + ". Fix: the name after ':' is a function or class of that file")


def _find(module: str, value: str, key: str) -> Path | None:
    # the roles' `python -m` puts their directory first. sys.path itself, not a path list
    # handed to PathFinder: a package installed in editable mode is found by a finder of its
    # own on sys.meta_path, which only a real import machinery walk consults
    path = [os.getcwd(), *sys.path]
    saved = sys.path
    sys.path = path
    try:
        spec = importlib.util.find_spec(module)
    except ImportError as e:  # a package above it is missing
        spec, error = None, str(e)
    else:
        error = ""
    finally:
        sys.path = saved
    if spec is None:
        raise ConfigError(
            f"{key}={value!r}: no module {module!r} here{f' ({error})' if error else ''}. Fix: "
            "install it, run from the directory that holds it, add its directory to "
            "PYTHONPATH, or name the file: path/to/file.py:name")
    origin = spec.origin
    return Path(origin) if origin and origin.endswith(".py") else None


def _top_level_names(tree: ast.Module) -> tuple[set[str], set[str], bool]:
    """The names a module binds at its top level (also under if/try), those of its functions
    and classes, and whether more may be bound (`from x import *`, a module `__getattr__`)."""
    names: set[str] = set()
    defs: set[str] = set()
    star = False
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            defs.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    star = True
                else:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return names, defs, star or "__getattr__" in names  # PEP 562: any name may resolve
