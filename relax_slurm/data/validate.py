"""Check the data files before any role starts: every line of a jsonl file parses to a JSON
object holding the columns the config names, and a parquet file has those columns.

Otherwise the first sign of bad data is a traceback of the rollout worker, after the engines
have loaded. Errors name `file:line` (1-based, as editors and `sed -n Np` count) and the config
field that names a missing column. Only the file's structure is checked here; what a cell may
hold (chat messages, media) is the dataset reader's concern (data/dataset.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from relax_slurm.config.data import DataConfig
from relax_slurm.errors import DataError

JSON_SUFFIXES = (".jsonl", ".json")


def required_columns(cfg: DataConfig) -> dict[str, str]:
    """column -> the config field that names it (the fix for a file without it)."""
    cols = {cfg.prompt_key: "data.prompt_key", cfg.label_key: "data.label_key"}
    if cfg.metadata_key:
        cols[cfg.metadata_key] = "data.metadata_key"
    for kind, key in cfg.multimodal_keys.items():
        cols[key] = f"data.multimodal_keys.{kind}"
    return cols


def json_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(1-based line, parsed value) of each non-blank line; DataError at the first line that is
    not JSON, naming `path:line` and the parser's message."""
    with open(path, encoding="utf-8") as f:
        try:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line.rstrip("\r\n"))  # columns of this line
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{path}:{line_no}: not valid JSON: {e.msg} at column {e.colno}. Fix "
                        "that line (each line of a .jsonl file is one JSON object) or remove "
                        "the file from data.train_files") from e
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e}). Fix: save it as UTF-8") from e


def check_row(path: Path, line_no: int, row: object, columns: dict[str, str]) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{path}:{line_no}: a JSON {type(row).__name__}, not an object. Fix: "
                        'one object per line, e.g. {"prompt": "1+1=", "label": "2"}')
    for column, option in columns.items():
        if row.get(column) is None:
            state = "is null" if column in row else "is missing"
            raise DataError(
                f"{path}:{line_no}: column {column!r} ({option}) {state}; the row has "
                f"{sorted(row)}. Fix: fill it in, or set {option}=<the column that holds it>")


def check_jsonl(path: Path, columns: dict[str, str]) -> int:
    """Rows of a jsonl file (or a .json file of one object per line); DataError at the first
    bad one. A .json file holding one JSON array is checked element by element."""
    if path.suffix.lower() == ".json" and _starts_with(path, "["):
        return _check_json_array(path, columns)
    rows = 0
    for line_no, row in json_rows(path):
        check_row(path, line_no, row, columns)
        rows += 1
    return rows


def _starts_with(path: Path, char: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(4096).lstrip().startswith(char)


def _check_json_array(path: Path, columns: dict[str, str]) -> int:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON: {e.msg} at column {e.colno}. Fix "
                        "the file or remove it from data.train_files") from e
    for i, row in enumerate(rows):
        check_row(path, i + 1, row, columns)  # element i+1 of the array, as a line number
    return len(rows)


def check_parquet(path: Path, columns: dict[str, str]) -> None:
    import pyarrow.parquet as pq  # a dependency of datasets; only needed for parquet files

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # pyarrow's errors for a file that is not parquet vary by version
        raise DataError(f"{path}: cannot read it as parquet ({type(e).__name__}: {e}). Fix the "
                        "file or remove it from data.train_files") from e
    for column, option in columns.items():
        if column not in names:
            raise DataError(f"{path}: no column {column!r} ({option}); the columns are {names}. "
                            f"Fix: set {option}=<one of the columns>")


def check_files(files: list[str], columns: dict[str, str]) -> None:
    """Check each file (folders of saved datasets are left to the reader: reading them is the
    check; missing paths to the launcher's own check). DataError for the first problem."""
    for name in files:
        path = Path(name)
        if path.is_dir() or not path.exists():
            continue
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the file is empty. Fix: remove it from the list")
        suffix = path.suffix.lower()
        if suffix in JSON_SUFFIXES:
            check_jsonl(path, columns)
        elif suffix == ".parquet":
            check_parquet(path, columns)


def check_data_files(cfg: DataConfig, eval_files: list[str] = ()) -> None:
    """data.train_files, and eval.datasets (read with the same keys)."""
    columns = required_columns(cfg)
    check_files(list(cfg.train_files), columns)
    check_files(list(eval_files), columns)
