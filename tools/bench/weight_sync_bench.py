"""Part 4: a full weight sync (bucketed, through an engine's HTTP routes) vs a raw broadcast.

The full sync is what the trainer does each step: `WeightSender.send` to a real hf engine
process (HTTP /update_weights_from_distributed per bucket, one gloo broadcast per tensor, the
engine receiving into its model's parameters), and the same with
weight_sync.load_format=flattened_bucket (one broadcast per bucket: the sender copies the
bucket into a kept buffer, the engine receives into its parameters once they adopted the first
bucket's buffer). The baseline is one `torch.distributed` broadcast of the same number of bytes
as one flat tensor in a gloo group of the same two kinds of process, followed by a barrier so
that it, too, ends when the receiver has everything.
Efficiency = raw time / full-sync time. The engine (and the raw receiver) run on core 0, the
sender on core 1.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO

GROUP = "bench_raw"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def make_state_model(out: Path, target_mb: float) -> Path:
    """A random Qwen3 of at most `target_mb` MiB of fp32 weights (hidden 1024, 64 MiB per
    layer: 7 layers, 470 MB, for 480), saved like a real checkpoint so the engine loads it the
    ordinary way."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hidden = 1024
    per_layer_mb = (4 * hidden * hidden + 3 * hidden * 4 * hidden) * 4 / 2**20
    layers = max(1, int(target_mb / per_layer_mb))
    cfg = Qwen3Config(vocab_size=32, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                      head_dim=64, tie_word_embeddings=True, dtype="float32",
                      eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def start_engine(model: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "relax_slurm.engines.hf", "--model-path", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--torch-threads", "1", "--seed", "0", "--weight-version", "0"]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                cwd=REPO, start_new_session=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, [0]))


class RawBroadcast:
    """The baseline: rank 0 here, rank 1 a child process on core 0 that receives `count`
    broadcasts of `nbytes` (each followed by a barrier), one per call of `once`."""

    def __init__(self, nbytes: int, count: int) -> None:
        import torch

        from relax_slurm.weightsync.group import init_weight_update_group
        port = free_port()
        cmd = [sys.executable, __file__, "--raw-receiver", "--port", str(port),
               "--nbytes", str(nbytes), "--repeats", str(count - 1)]
        self.proc = subprocess.Popen(cmd, env=child_env(), cwd=REPO, start_new_session=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, [0]))
        # one group name per measurement: torch refuses a name twice in one process
        self.pg = init_weight_update_group("127.0.0.1", port, 0, 2, f"{GROUP}_{port}",
                                           timeout_s=600)
        self.buf = torch.ones(nbytes, dtype=torch.uint8)

    def once(self) -> float:
        import torch.distributed as dist
        t0 = time.perf_counter()
        dist.broadcast(self.buf, src=0, group=self.pg)
        dist.barrier(group=self.pg)
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def raw_receiver(port: int, nbytes: int, repeats: int) -> None:
    """Rank 1 of the raw baseline (runs in its own process)."""
    import torch
    import torch.distributed as dist

    from relax_slurm.weightsync.group import init_weight_update_group
    pg = init_weight_update_group("127.0.0.1", port, 1, 2, f"{GROUP}_{port}", timeout_s=600)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats + 1):
        dist.broadcast(buf, src=0, group=pg)
        dist.barrier(group=pg)
    # done: leave without the interpreter's teardown, which destroys the group's gloo threads
    # still joinable and may abort ("terminate called without an active exception" in the
    # bench's output, session 54), as the product's roles leave
    from relax_slurm.runtime.exit import exit_now
    exit_now(0)


FORMATS = {"full_s": None, "flat_s": "flattened_bucket"}
"""The full sync's formats: one broadcast per tensor (the default), one per flattened bucket."""


ROUNDS = 5
"""Timed rounds per repeat. One sync's time moves by 2x from one round to the next on a shared
2-core machine (a 448 MB sync: efficiency 0.36-0.88 over 15 rounds), so a repeat's figure is
the median of its rounds (3 repeats of 5: medians within ~5% of each other). The quick and
the full run time the same rounds: this part has no steps to shorten."""


def measure(model: Path, repeats: int, workdir: Path, rounds: int = ROUNDS) -> dict:
    """`repeats` x `rounds` rounds after one warm-up round; a round is, back to back, a full
    sync per tensor, one per flattened bucket (the same engine and sender) and a raw broadcast
    of the same bytes, so that a drift of the (shared) machine hits the three alike. Per
    repeat: the median over its rounds of each time, GB/s and ratio (a ratio per round first,
    then the median); `rounds_*` keep every round's values."""
    import torch
    from transformers import AutoModelForCausalLM

    from relax_slurm.engines.client import wait_until_healthy
    from relax_slurm.weightsync.sender import WeightSender

    # the sender on core 1 with one torch thread, as documented: run.py's process is not
    # pinned otherwise, and there its flattened syncs measured 2-3x its per-tensor ones on a
    # loaded machine, against 1.0-1.1x pinned
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, [1 % os.cpu_count()])
    torch.set_num_threads(1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = start_engine(model, port, workdir / f"engine_{model.name}.log")
    sender = raw = None
    count = repeats * rounds + 1  # the first round is warm-up
    try:
        wait_until_healthy([url], timeout_s=600)
        weights = [(n, p.detach()) for n, p in
                   AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
                   .named_parameters()]
        # the run's default bucket size (weight_sync.bucket_mb)
        sender = WeightSender([url], "127.0.0.1", free_port(), timeout_s=600, bucket_mb=512)
        sender.connect()
        times: dict[str, list[float]] = {"full_s": [], "flat_s": [], "raw_s": []}
        stats: dict = {}
        version = 0
        for _ in range(count):
            for key, load_format in FORMATS.items():
                sender.load_format = load_format
                version += 1
                stats = sender.send(weights, version=version)
                times[key].append(stats["seconds"])
            if raw is None:
                raw = RawBroadcast(stats["bytes"], count)
            times["raw_s"].append(raw.once())
        times = {k: v[1:] for k, v in times.items()}
    finally:
        if sender is not None:
            sender.close()
        if raw is not None:
            raw.close()
        engine.terminate()
        engine.wait(timeout=30)
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    gb = stats["bytes"] / 1e9
    full, flat, raw_s = times["full_s"], times["flat_s"], times["raw_s"]
    per_round = {"full_s": full, "raw_s": raw_s, "flat_s": flat,
                 "full_gbps": [gb / t for t in full], "raw_gbps": [gb / t for t in raw_s],
                 # per round, as measured back to back
                 "efficiency": [r / f for r, f in zip(raw_s, full)],
                 "efficiency_flattened": [r / f for r, f in zip(raw_s, flat)]}
    return {"mb": stats["bytes"] / 2**20, "tensors": len(weights),
            "buckets": stats["num_buckets"], "rounds": rounds,
            **{k: per_repeat(v, rounds) for k, v in per_round.items()},
            **{f"rounds_{k}": v for k, v in per_round.items()}}


def per_repeat(values: list[float], rounds: int) -> list[float]:
    """The median of each repeat's `rounds` consecutive values."""
    return [statistics.median(values[i:i + rounds]) for i in range(0, len(values), rounds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw-receiver", action="store_true")
    ap.add_argument("--port", type=int)
    ap.add_argument("--nbytes", type=int)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--model", type=Path)
    args = ap.parse_args()
    if args.raw_receiver:
        raw_receiver(args.port, args.nbytes, args.repeats)
        return
    os.sched_setaffinity(0, [1 % os.cpu_count()])
    r = measure(args.model, args.repeats, Path("."), args.rounds)
    print({k: (statistics.median(v) if isinstance(v, list) else v) for k, v in r.items()
           if not k.startswith("rounds_")})


if __name__ == "__main__":
    main()
