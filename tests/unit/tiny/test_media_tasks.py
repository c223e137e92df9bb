"""The mixed media rows the omni thinker trains on (media_tasks.mix_rows)."""

from __future__ import annotations

import json
from pathlib import Path

from relax_slurm.tiny.media_tasks import mix_rows, prepare


def test_mixed_rows_carry_every_column_absolute_paths_and_their_task(tmp_path: Path):
    prepare(tmp_path, "colors", n_train=6, n_test=1)
    prepare(tmp_path, "tones", n_train=5, n_test=1)
    (tmp_path / "sub").mkdir()
    out = mix_rows(tmp_path, {"colors": "images", "tones": "audios"}, tmp_path / "sub" / "m.jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 11
    assert sorted(r["id"].split("-")[0] for r in rows) == ["colors"] * 6 + ["tones"] * 5
    for r in rows:
        media = r["images"] + r["audios"]
        assert len(media) == 1 and Path(media[0]).is_absolute() and Path(media[0]).exists()
        assert (r["images"] == []) == r["id"].startswith("tones")
    # shuffled, and the same shuffle every time
    assert [r["id"] for r in rows] != sorted(r["id"] for r in rows)
    again = mix_rows(tmp_path, {"colors": "images", "tones": "audios"}, tmp_path / "again.jsonl")
    assert again.read_text() == out.read_text()
