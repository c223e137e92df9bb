"""launch/ imports one way (docs/architecture.md, "The launcher in layers"): entry points on top,
the supervision below them, helpers at the bottom; no file circle, counting function-level
imports; no private name imported from another file. A new file must be given its layer here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LAUNCH = REPO / "relax_slurm" / "launch"

LAYERS = [  # top first
    {"cli", "sweep", "local", "sbatch", "submit", "slurm_driver", "ctl"},
    {"supervisor", "scale", "engine_job", "restart", "health"},
    {"inputs", "compose", "placement", "roles", "slurm_options", "submitit_jobs", "rerun",
     "records", "processes", "slurm_env", "node_health", "interrupt", "help", "dump", "launch",
     "choices", "launcher_log", "waiting", "hub_models"},
]


def _import_graph():
    path = REPO / "tools" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _short(mod: str) -> str:
    return mod.rsplit(".", 1)[-1]


def test_every_file_of_launch_has_a_layer():
    files = {p.stem for p in LAUNCH.glob("*.py")} - {"__init__"} | {"launch"}
    placed = set().union(*LAYERS)
    assert files == placed, f"not placed: {sorted(files - placed)}; gone: {sorted(placed - files)}"


def test_launch_imports_go_down_only_and_form_no_circle():
    ig = _import_graph()
    edges, private = ig.graph(LAUNCH)
    assert ig.cycles(edges) == []
    layer = {name: k for k, names in enumerate(LAYERS) for name in names}
    upward = [f"{_short(a)} -> {_short(b)} (line {', '.join(where)})"
              for a, dests in edges.items() for b, where in dests.items()
              if layer[_short(a)] > layer[_short(b)]]
    assert upward == [], "imports from a lower layer up to a higher one"
    assert private == []


def test_the_graph_sees_lazy_imports_and_circles(tmp_path):
    # the checker itself: a function-level import closing a circle is found
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import _g\n")
    ig = _import_graph()
    edges, private = ig.graph(pkg)
    assert edges["pkg.b"] == {"pkg.a": ["2 lazy"]}
    assert ig.cycles(edges) == [["pkg.a", "pkg.b"]]
    assert private == ["b imports a._g (line 2)"]
