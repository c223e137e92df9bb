"""The tiny model's files: readable like any other new file (save_pretrained's are 0600)."""

from __future__ import annotations

import os


def test_tiny_model_files_follow_the_umask(tiny_assets):
    umask = os.umask(0)
    os.umask(umask)
    files = [p for p in (tiny_assets / "model").iterdir() if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {
        p.name: 0o666 & ~umask for p in files}
