"""Where a full weight sync's time goes: phases of `WeightSender.send` to a real hf engine.

    python tools/bench/weight_sync_profile.py --model bench_out/assets/state500 [--repeats 5]

The same harness as weight_sync_bench (engine on core 0, sender on core 1, one torch thread
each), with the sender's phases timed by wrapping its methods in this process, and the
engine's from its log line per update (lock, receive, load). Each repeat syncs per tensor, then
flattened, then broadcasts the same bytes raw; medians (min-max) over the repeats are printed
as a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from common import REPO

sys.path.insert(0, str(REPO))

import weight_sync_bench as wsb  # noqa: E402

ENGINE_LINE = re.compile(r"loaded \d+ tensors .* in ([\d.]+)s: lock ([\d.]+)s, receive "
                         r"([\d.]+)s, load ([\d.]+)s")


def instrument(current: list[dict[str, float]]) -> None:
    """Wrap the sender's steps (once) so each adds its seconds to current[0][name]."""
    import torch.distributed as dist

    from relax_slurm.weightsync import sender as snd

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                current[0][name] += time.perf_counter() - t0
        return wrapper

    def timed_stream(name, gen_fn):
        """A generator's time inside each of its steps (the sender reads its buckets as a
        stream: timing the call alone would time making the generator)."""
        def wrapper(*a, **kw):
            it = gen_fn(*a, **kw)
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    current[0][name] += time.perf_counter() - t0
                yield item
        return wrapper

    if hasattr(snd, "stream_buckets"):  # the sender streams its buckets (since session 25)
        snd.stream_buckets = timed_stream("sender: bucketing", snd.stream_buckets)
    else:
        snd.bucket_named_tensors = timed("sender: bucketing", snd.bucket_named_tensors)
    flat = "sender: flatten into the bucket"
    snd.flatten_bucket = timed(flat, snd.flatten_bucket)
    if hasattr(snd, "FlatBuffer"):  # the kept buffer (absent before it existed)
        snd.FlatBuffer.flatten = timed(flat, snd.FlatBuffer.flatten)
    snd.dist.broadcast = timed("sender: issue broadcasts", dist.broadcast)
    join, poll = snd.WeightSender._join, snd.WeightSender._poll

    def join_timed(self, route, futures):
        t0 = time.perf_counter()
        try:
            return join(self, route, futures)
        finally:
            key = ("HTTP tail of /update_weights_from_distributed (after the broadcasts)"
                   if route == "/update_weights_from_distributed" else f"HTTP {route}")
            current[0][key] += time.perf_counter() - t0

    snd.WeightSender._join = join_timed
    snd.WeightSender._poll = timed("sender: wait for the broadcasts", poll)


def engine_phases(log: Path, skip: int) -> list[tuple[float, ...]]:
    found = [tuple(map(float, m.groups())) for m in ENGINE_LINE.finditer(log.read_text())]
    return found[skip:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    os.sched_setaffinity(0, [1 % os.cpu_count()])
    import torch
    from transformers import AutoModelForCausalLM

    from relax_slurm.engines.client import wait_until_healthy
    from relax_slurm.weightsync.sender import WeightSender

    torch.set_num_threads(1)
    weights = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32).named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    port = wsb.free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.workdir / "profile_engine.log"
    engine = wsb.start_engine(args.model, port, log)
    rows: dict[str, dict[str, list[float]]] = {}
    try:
        wait_until_healthy([url], timeout_s=600)
        sender = WeightSender([url], "127.0.0.1", wsb.free_port(), timeout_s=600, bucket_mb=512)
        sender.connect()
        formats = {"per tensor": None, "flattened_bucket": "flattened_bucket"}
        for fmt in formats.values():  # warm-up of each format
            sender.load_format = fmt
            sender.send(weights, version=0)
        done = len(formats)
        raw, baseline = [], wsb.RawBroadcast(nbytes, args.repeats + 1)
        baseline.once()  # warm-up
        current: list[dict[str, float]] = [defaultdict(float)]
        instrument(current)
        for i in range(args.repeats):
            for label, fmt in formats.items():
                sender.load_format = fmt
                phases = current[0] = defaultdict(float)
                t0 = time.perf_counter()
                stats = sender.send(weights, version=i + 1)
                phases["total (sender)"] = time.perf_counter() - t0
                for _ in range(100):  # the engine logs after it answered
                    lines = engine_phases(log, done)
                    if lines:
                        break
                    time.sleep(0.01)
                done += len(lines)
                total, lock, receive, load = (sum(x) for x in zip(*lines))
                phases["engine: wait for the model lock"] = lock
                phases["engine: receive (broadcasts)"] = receive
                phases["engine: load into parameters"] = load
                # the request goes out before the sender flattens and broadcasts: what the
                # sender waited for the update beyond the engine's handler is HTTP and JSON
                phases["HTTP + JSON of the update, outside the engine's handler"] = sum(
                    phases[k] for k in ("sender: flatten into the bucket",
                                        "sender: issue broadcasts",
                                        "sender: wait for the broadcasts",
                                        "HTTP tail of /update_weights_from_distributed (after "
                                        "the broadcasts)")) - total
                for k, v in phases.items():
                    rows.setdefault(k, {}).setdefault(label, []).append(v)
                assert stats["bytes"] == nbytes
            current[0] = defaultdict(float)  # the raw broadcast below is not the sender's
            raw.append(baseline.once())
        sender.close()
        baseline.close()
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    rows.setdefault("raw broadcast + barrier (baseline)", {})["per tensor"] = raw

    def fmt(v: list[float]) -> str:
        return f"{statistics.median(v):.4f} ({min(v):.4f}-{max(v):.4f})" if v else ""

    print(f"{nbytes / 2**20:.1f} MiB, {len(weights)} tensors, {args.repeats} repeats")
    print("| phase | per tensor, s | flattened_bucket, s |\n|---|---|---|")
    for k, by in rows.items():
        print(f"| {k} | {fmt(by.get('per tensor', []))} | "
              f"{fmt(by.get('flattened_bucket', []))} |")


if __name__ == "__main__":
    main()
