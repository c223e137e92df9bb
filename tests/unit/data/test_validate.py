"""Data files are checked before any role starts: file:line (1-based), the JSON error, and the
config field naming a missing column."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_slurm.config.data import DataConfig
from relax_slurm.data.validate import check_data_files
from relax_slurm.errors import DataError
from tests.conftest import REPO, run_env

GOOD = '{"prompt": "1+1=", "label": "2"}\n'
CASES = {
    # name: (file name, content, DataConfig overrides, fragments besides the path)
    "bad json on line 3, after a blank line": (
        "j.jsonl", GOOD + "\n" + '{"prompt": "2+2=", "label": }\n', {},
        [":3: not valid JSON", "Expecting value at column"]),
    "not an object": ("o.jsonl", GOOD + "[1, 2]\n", {}, [":2: a JSON list, not an object"]),
    "missing label": ("l.jsonl", GOOD + '{"prompt": "2+2="}\n', {},
                      [":2: column 'label' (data.label_key) is missing", "['prompt']",
                       "data.label_key=<"]),
    "null prompt": ("n.jsonl", '{"prompt": null, "label": "2"}\n', {},
                    [":1: column 'prompt' (data.prompt_key) is null"]),
    "renamed prompt column": ("q.jsonl", '{"question": "1+1=", "label": "2"}\n', {},
                              [":1: column 'prompt' (data.prompt_key)", "['label', 'question']"]),
    "metadata column": ("m.jsonl", GOOD, {"metadata_key": "meta"},
                        [":1: column 'meta' (data.metadata_key) is missing"]),
    "media column": ("i.jsonl", GOOD, {"multimodal_keys": {"image": "images"}},
                     ["column 'images' (data.multimodal_keys.image)"]),
    "json array element": ("a.json", f"[{GOOD.strip()}, {{\"prompt\": \"x\"}}]", {},
                           [":2: column 'label'"]),
    "empty": ("e.jsonl", "", {}, ["empty"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_files_name_file_line_and_field(tmp_path, case):
    name, content, overrides, fragments = CASES[case]
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as e:
        check_data_files(DataConfig(train_files=[str(path)], **overrides))
    msg = str(e.value)
    assert str(path) in msg and "Fix" in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_good_files_pass_and_parquet_columns_are_checked(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "ok.jsonl"
    jsonl.write_text(GOOD * 3 + "\n")
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), table)
    check_data_files(DataConfig(train_files=[str(jsonl)]))
    check_data_files(DataConfig(train_files=[str(table)], label_key="answer"))
    with pytest.raises(DataError, match=r"no column 'label' \(data.label_key\).*answer"):
        check_data_files(DataConfig(train_files=[str(table)]))
    with pytest.raises(DataError, match="bad.jsonl:1"):
        check_data_files(DataConfig(train_files=[str(jsonl)]), eval_files=[str(_bad(tmp_path))])


def _bad(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{nope\n")
    return path


def test_relax_train_reports_bad_data_before_any_role_starts(tmp_path):
    """The real launcher: exit 1 naming file:line; nothing started, and no run directory is
    left behind (Hydra had made one with only .hydra/ in it)."""
    data = tmp_path / "train.jsonl"
    data.write_text(GOOD + '{"prompt": "3+3=", "label": "6"\n')
    run_dir = tmp_path / "run"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # passes the launcher's model check; never loaded
    proc = subprocess.run(
        [sys.executable, "-m", "relax_slurm.launch.cli", "experiment=tiny_cpu",
         f"run_dir={run_dir}", f"model.path={model}", f"data.train_files=[{data}]"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=run_env())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"{data}:2: not valid JSON: Expecting ',' delimiter at column 32" in proc.stderr, \
        proc.stderr[-2000:]
    assert not run_dir.exists()
