"""The docs say what the code has: every relative link and anchor resolves, every config key a
doc names in code format exists in the schema, and every preset a doc selects (`algo=NAME`,
`reward=NAME`, `experiment=NAME`, ...) and every `algo.name=` / `reward.name=` is registered.

What cannot be checked this way (prose claims) is read by hand; this keeps the mechanical part
from drifting as keys and presets are renamed.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from relax_slurm.algos import registry as algos
from relax_slurm.config.schema import TrainConfig
from relax_slurm.config.variants import variants_of
from relax_slurm.rewards import registry as rewards

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "relax_slurm" / "conf"
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]

# spelled wrong on purpose: docs/configuration.md shows the error these typos get
DELIBERATE_TYPOS = {"trainer.total_step", "trainer.max_staleness", "tiny_cpux", "gpro"}
PLACEHOLDERS = {"...", "X", "NAME", "N"}
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"```.*?```", re.S)


def code_spans(doc: Path) -> list[str]:
    return CODE_SPAN.findall(FENCE.sub("", doc.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", doc.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m[1])
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def field_type(cls: type, name: str) -> type:
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 else hint


def key_exists(key: str) -> bool:
    """`section.field[.sub...]` names a field of TrainConfig's dataclasses (a dict-valued or
    free-form leaf may be followed by anything; `cluster.*` a field of either variant)."""
    classes: list[typing.Any] = [TrainConfig]
    for part in key.split("."):
        if not classes:
            return True  # a mapping's own keys (e.g. rollout.engine_args.*)
        having = [c for c in classes if part in {f.name for f in dataclasses.fields(c)}]
        if not having:
            return False
        subs = [field_type(c, part) for c in having]
        classes = [v for sub in subs if dataclasses.is_dataclass(sub) for v in variants_of(sub)]
    return True


SECTIONS = {f.name for f in dataclasses.fields(TrainConfig)
            if dataclasses.is_dataclass(field_type(TrainConfig, f.name))}
# backticked `section.key` (alone, or as an override `section.key=value`); `model.` and `env.`
# spans are also parameter and method names (`model.visual`, `env.reset`): overrides only
KEY = re.compile(r"(?<![\w./+-])\+?([a-z_]+(?:\.[a-z_0-9]+)+)(=|$)")
ALSO_CODE = ("model.", "env.")
FILE_SUFFIXES = {"jsonl", "json", "yaml", "md", "py", "log", "txt", "safetensors", "pt"}


def config_keys(doc: Path) -> set[str]:
    keys = set()
    for span in code_spans(doc):
        for token in span.split():
            m = KEY.match(token)
            if not m or m[1].split(".")[0] not in SECTIONS:
                continue
            if m[1].startswith(ALSO_CODE) and not m[2] or m[1].rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue
            keys.add(m[1])
    return keys - DELIBERATE_TYPOS


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not broken, f"{doc.name}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_a_doc_names_exists(doc):
    missing = sorted(k for k in config_keys(doc) if not key_exists(k))
    assert not missing, f"{doc.name} names config keys the schema lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_preset_and_registered_name_a_doc_selects_exists(doc):
    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    registered = {"algo": set(algos.names()), "reward": set(rewards.names())}
    missing = []
    for span in code_spans(doc):
        for key, values in re.findall(r"(?<![\w.+-])\+?([\w.]+)=([\w.,|\-]+)", span):
            for name in filter(None, re.split(r"[|,]", values)):
                if name in PLACEHOLDERS | DELIBERATE_TYPOS or "." in name:
                    continue  # a dotted name is a module (reward.name=package.module)
                if key in groups and not (CONF / key / f"{name}.yaml").exists():
                    missing.append(f"{key}={name} (no conf/{key}/{name}.yaml)")
                section = key.removesuffix(".name")
                if key.endswith(".name") and section in registered \
                        and name not in registered[section]:
                    missing.append(f"{key}={name} (not registered)")
    assert not missing, f"{doc.name}: {missing}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A wrong key, a wrong preset and a dangling anchor are found (the checks can fail)."""
    assert key_exists("algo.max_staleness") and key_exists("cluster.partition")
    assert not key_exists("algo.max_stalenes") and not key_exists("trainer.max_staleness")
    doc = tmp_path / "x.md"
    doc.write_text("# Title here\n`algo.nope=1` and [a](#title-here) [b](#gone)\n")
    assert config_keys(doc) == {"algo.nope"}
    assert "title-here" in anchors(doc) and "gone" not in anchors(doc)
