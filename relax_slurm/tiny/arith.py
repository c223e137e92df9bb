"""Write the "a+b=" -> a+b prompt sets of the embedded CPU default.

    python tools/prepare_data.py --out tiny

Writes OUT/arith_train.jsonl and OUT/arith_test.jsonl, one row per line:
{"prompt": "3+4=", "label": "7", "id": "train-0"}. a and b are digits up to --max-operand and
the label is the last digit of a+b. The default, 4, gives 25 distinct prompts with single-digit
answers: a table the ~100k-parameter tiny model learns by RL in about 200 steps on 2 CPU cores
(--max-operand 9, the full table mod 10, takes thousands). The test set is a separate random
draw (a held-out order, not held-out prompts), which is enough to measure whether the model
learned the table.
Standard library only, so it runs in well under a second.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path


def make_rows(n: int, rng: random.Random, split: str, max_operand: int = 4
              ) -> list[dict[str, str]]:
    """`n` rows of random sums of digits 0..max_operand, labelled with the sum's last digit."""
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"prompt": f"{a}+{b}=", "label": str((a + b) % 10), "id": f"{split}-{i}"})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_splits(out: Path, task: str, rows: Callable[[int, random.Random, str], list[dict]],
                 n_train: int, n_test: int, seed: int) -> list[Path]:
    """OUT/<task>_train.jsonl and OUT/<task>_test.jsonl from `rows(n, rng, split)`, drawn in
    that order from one seeded generator; returns their paths (train first)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        path = out / f"{task}_{split}.jsonl"
        write_jsonl(path, rows(n, rng, split))
        paths.append(path)
    return paths


def splits_parser(description: str) -> argparse.ArgumentParser:
    """The options of every tiny task's command line: --out, --n-train, --n-test, --seed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, help="directory to write the jsonl files")
    parser.add_argument("--n-train", type=int, default=5000)
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_split_args(parser: argparse.ArgumentParser,
                     argv: list[str] | None) -> argparse.Namespace:
    """The parsed options, the split sizes checked."""
    args = parser.parse_args(argv)
    if args.n_train < 1 or args.n_test < 0:
        parser.error("--n-train must be >= 1 and --n-test >= 0")
    return args


def report_splits(paths: list[Path], args: argparse.Namespace) -> int:
    train, test = paths
    print(f"wrote {train} ({args.n_train} rows) and {test} ({args.n_test} rows)")
    return 0


def prepare(out: Path, n_train: int = 5000, n_test: int = 500, seed: int = 0,
            max_operand: int = 4) -> list[Path]:
    """Write both splits under `out`; returns their paths (train first)."""
    return write_splits(out, "arith",
                        lambda n, rng, split: make_rows(n, rng, split, max_operand),
                        n_train, n_test, seed)


def main(argv: list[str] | None = None) -> int:
    parser = splits_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-operand", type=int, default=4,
                        help="largest digit a and b take (0-9); 9 is the full table mod 10")
    args = parse_split_args(parser, argv)
    if not 0 <= args.max_operand <= 9:
        parser.error(f"--max-operand must be a digit 0-9, got {args.max_operand}")
    return report_splits(prepare(Path(args.out), args.n_train, args.n_test, args.seed,
                                 args.max_operand), args)


if __name__ == "__main__":
    sys.exit(main())
