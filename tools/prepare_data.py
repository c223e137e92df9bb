"""Write the "a+b=" -> (a+b) mod 10 prompt sets of the embedded CPU default.

    python tools/prepare_data.py --out tiny

Writes OUT/arith_train.jsonl and OUT/arith_test.jsonl, one row per line:
{"prompt": "3+4=", "label": "7", "id": "train-0"}. a and b are single digits, so there are only
100 distinct prompts: the test set is a separate random draw (a held-out order, not held-out
prompts), which is enough to measure whether the model learned the table.
Standard library only, so it runs in well under a second.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def make_rows(n: int, rng: random.Random, split: str) -> list[dict[str, str]]:
    """`n` rows of random single-digit sums, labelled with the last digit of the sum."""
    rows = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"prompt": f"{a}+{b}=", "label": str((a + b) % 10), "id": f"{split}-{i}"})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def prepare(out: Path, n_train: int = 5000, n_test: int = 500, seed: int = 0) -> list[Path]:
    """Write both splits under `out`; returns their paths (train first)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        path = out / f"arith_{split}.jsonl"
        write_jsonl(path, make_rows(n, rng, split))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the jsonl files")
    parser.add_argument("--n-train", type=int, default=5000)
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.n_train < 1 or args.n_test < 0:
        parser.error("--n-train must be >= 1 and --n-test >= 0")
    train, test = prepare(Path(args.out), args.n_train, args.n_test, args.seed)
    print(f"wrote {train} ({args.n_train} rows) and {test} ({args.n_test} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
