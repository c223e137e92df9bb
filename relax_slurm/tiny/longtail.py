"""Write the "d*n=" -> "ddd..." prompt sets of the long-tail benchmark (docs/benchmarks.md).

    python tools/prepare_data.py --task longtail --out tiny

Writes OUT/longtail_train.jsonl and OUT/longtail_test.jsonl, one row per line:
{"prompt": "7*3=", "label": "777", "id": "train-0"}: repeat the digit d n times. The answer
needs n generated tokens (plus EOS), and n is heavy-tailed: a discrete Pareto draw,
P(n >= k) = k ** -alpha, capped at --max-repeat. With the defaults (alpha 1.2, cap 30) about
56% of prompts want one digit, 81% at most three, and ~2% the cap: most responses are short
and a few run to the end of `rollout.max_new_tokens`, which is the shape of a reasoning
model's response lengths. Reward: `prefix_match` (rewards/prefix_match.py), partial credit
for a right prefix, so the tiny model learns the short answers first and the long ones after.
Standard library only.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from relax_slurm.tiny.arith import parse_split_args, report_splits, splits_parser, write_splits

ALPHA = 1.2
MAX_REPEAT = 30


def draw_repeat(rng: random.Random, alpha: float = ALPHA, max_repeat: int = MAX_REPEAT) -> int:
    """n >= 1 with P(n >= k) = k ** -alpha for k <= max_repeat (the rest lands on the cap)."""
    u = 1.0 - rng.random()  # (0, 1]
    return min(max_repeat, int(u ** (-1.0 / alpha)))


def make_rows(n: int, rng: random.Random, split: str, alpha: float = ALPHA,
              max_repeat: int = MAX_REPEAT) -> list[dict[str, str]]:
    """`n` rows "d*k=" labelled with the digit d repeated k times, k heavy-tailed."""
    rows = []
    for i in range(n):
        d, k = rng.randint(0, 9), draw_repeat(rng, alpha, max_repeat)
        rows.append({"prompt": f"{d}*{k}=", "label": str(d) * k, "id": f"{split}-{i}"})
    return rows


def prepare(out: Path, n_train: int = 5000, n_test: int = 500, seed: int = 0,
            alpha: float = ALPHA, max_repeat: int = MAX_REPEAT) -> list[Path]:
    """Write both splits under `out`; returns their paths (train first)."""
    return write_splits(out, "longtail",
                        lambda n, rng, split: make_rows(n, rng, split, alpha, max_repeat),
                        n_train, n_test, seed)


def main(argv: list[str] | None = None) -> int:
    parser = splits_parser(__doc__.splitlines()[0])
    parser.add_argument("--alpha", type=float, default=ALPHA,
                        help="tail index of the repeat count: smaller is heavier")
    parser.add_argument("--max-repeat", type=int, default=MAX_REPEAT,
                        help="largest repeat count; keep it below rollout.max_new_tokens")
    args = parse_split_args(parser, argv)
    if args.alpha <= 0 or args.max_repeat < 1:
        parser.error("--alpha must be > 0 and --max-repeat >= 1")
    return report_splits(prepare(Path(args.out), args.n_train, args.n_test, args.seed,
                                 args.alpha, args.max_repeat), args)


if __name__ == "__main__":
    sys.exit(main())
