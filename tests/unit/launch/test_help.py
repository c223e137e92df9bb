"""Where relax-train's usage and --help send a user for the docs: files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from relax_slurm.launch import cli, help as help_mod


def test_a_source_checkout_names_its_doc_files(monkeypatch):
    text = cli.usage()
    paths = re.findall(r"(/\S+\.md)", text)
    assert paths and all(Path(p).is_file() for p in paths)


def test_an_installed_package_names_the_docs_without_a_path_it_lacks(tmp_path, monkeypatch):
    monkeypatch.setattr(help_mod, "DOCS_DIR", tmp_path / "site-packages" / "docs")
    text = cli.usage()
    assert "docs/quickstart.md" not in text and str(tmp_path) not in text
    assert "quickstart.md, configuration.md in the relax-slurm repository's docs/" in text
