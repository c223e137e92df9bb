"""Micro-benchmark of the broker wire format: encode + decode of one trainer batch.

    python tools/bench/wire_bench.py [--groups 32] [--samples 16] [--repeat 200]

Times `encode` and `decode` (relax_slurm/broker/wire.py) of one message holding `groups` groups
of `samples` samples (prompt 6 tokens, response 3 tokens, no teacher log-probs) and prints the
per-message time in ms (median and best over `repeat` runs). Decode reads the frames as bytes,
as a receiver would; the bytes copy is outside the timing. The broker's side: its decode of a put
(`keep_frames=True`) and its encode of those groups again (for its spill record and for the
trainer's batch), which sends the frames as they came.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from relax_slurm.broker.wire import decode, encode
from relax_slurm.sample_meta import SampleMeta
from relax_slurm.samples import Sample


def make_groups(n_groups: int, n_samples: int, prompt_len: int = 6,
                response_len: int = 3) -> list[list[Sample]]:
    """Groups as a rollout worker puts them: one stamp map per group (its samples share it, as
    rollout/single_turn.py does), one version span per sample."""
    rng = np.random.default_rng(0)
    stamps = [SampleMeta(t_start=1.0, t_end=2.0, worker=0,
                         data_state={"epoch": 0, "index": g, "seed": 0, "num_rows": 5000}
                         ).to_dict() for g in range(n_groups)]
    return [[Sample(prompt_id=f"p{g}", group_id=g, prompt_ids=rng.integers(0, 1000, prompt_len),
                    response_ids=rng.integers(0, 1000, response_len),
                    loss_mask=np.ones(response_len, np.float32),
                    rollout_logprobs=rng.standard_normal(response_len).astype(np.float32),
                    reward=float(i % 2), version=3, version_min=3, finish_reason="stop",
                    version_spans=[[3, 0, response_len]], metadata=stamps[g])
             for i in range(n_samples)] for g in range(n_groups)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    groups = make_groups(args.groups, args.samples)
    enc, dec, keep, again = [], [], [], []
    for _ in range(args.repeat + 5):  # the first 5 are warm-up
        t0 = time.perf_counter()
        frames = encode("batch", {"rid": 1}, groups)
        t1 = time.perf_counter()
        received = [bytes(f) for f in frames]
        t2 = time.perf_counter()
        _, _, out = decode(received)
        t3 = time.perf_counter()
        _, _, kept = decode(received, keep_frames=True)
        t4 = time.perf_counter()
        encode("batch", {"rid": 2}, kept)
        t5 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t3 - t2)
        keep.append(t4 - t3)
        again.append(t5 - t4)
    enc, dec, keep, again = enc[5:], dec[5:], keep[5:], again[5:]
    tot = [a + b for a, b in zip(enc, dec)]
    assert out is not None and sum(map(len, out)) == args.groups * args.samples
    print(f"{args.groups} groups x {args.samples} samples, {len(frames)} frames, "
          f"header {len(frames[0])} bytes")
    for name, xs in (("encode", enc), ("decode", dec), ("encode+decode", tot),
                     ("broker decode", keep), ("broker encode", again)):
        print(f"{name:14s} median {statistics.median(xs) * 1e3:7.3f} ms/message   "
              f"best {min(xs) * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
