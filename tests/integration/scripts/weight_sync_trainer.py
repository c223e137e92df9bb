"""torchrun --nproc-per-node 2 weight_sync_trainer.py --model-dir D --engines U1,U2 --port P --out F
    [--load-format flattened_bucket]

Both ranks share a default gloo group (as trainer ranks do). Rank 0 also forms the weight-sync
group with the engines, pushes perturbed weights twice, verifies them bit for bit, checks that
generation changed and that weight_version followed, and that verify() catches a mismatch.
Rank 1 waits at a barrier meanwhile. Rank 0 writes its findings as JSON to --out.
"""

import argparse
import json
import os
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from relax_slurm.errors import WeightSyncError
from relax_slurm.engines.client import EngineClient
from relax_slurm.weightsync import WeightSender, tensor_sha256

PROMPTS = [[4, 5, 13, 6, 14], [9, 10]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def perturbed(named, seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype)) for n, t in named]


def greedy_outputs(clients):
    return [[r.output_ids for r in c.generate(PROMPTS, GREEDY)] for c in clients]


class Export:
    """Copies of `named` made one at a time, as a gathering export makes them; records the
    most bytes of them alive at once."""

    def __init__(self, named):
        self.named, self.alive, self.most_alive, self.total = named, 0, 0, 0

    def _freed(self, nbytes):
        self.alive -= nbytes

    def __iter__(self):
        for n, t in self.named:
            copy = t.clone()
            nbytes = copy.numel() * copy.element_size()
            weakref.finalize(copy, self._freed, nbytes)
            self.alive += nbytes
            self.total += nbytes
            self.most_alive = max(self.most_alive, self.alive)
            yield n, copy
            del copy


def run_rank0(args):
    named = list(load_file(os.path.join(args.model_dir, "model.safetensors")).items())
    urls = args.engines.split(",")
    clients = [EngineClient(u, timeout_s=60) for u in urls]
    out = {"before": greedy_outputs(clients)}
    sender = WeightSender(urls, "127.0.0.1", args.port, group_name="relax_test_sync",
                          backend="gloo", timeout_s=60, bucket_mb=0.02,
                          load_format=args.load_format)
    sender.connect()
    out["bound_port"] = sender.master_port
    try:
        first = perturbed(named, seed=1)
        out["stats1"] = sender.send(first, version=1)
        out["num_tensors"] = len(first)
        sender.verify(first)
        out["after1"] = greedy_outputs(clients)
        out["versions1"] = [c.weight_version() for c in clients]
        out["gen_versions1"] = [r.weight_version for c in clients
                                for r in c.generate(PROMPTS, GREEDY)]
        embed = dict(first)["model.embed_tokens.weight"]
        out["tied_ok"] = all(c.weights_checksum()["lm_head.weight"] == tensor_sha256(embed)
                             for c in clients)

        second = perturbed(named, seed=2)
        out["stats2"] = sender.send(second, version="2")
        sender.verify(second)
        out["versions2"] = [c.weight_version() for c in clients]

        name, t = second[3]
        tampered = second[:3] + [(name, t + 1e-3)] + second[4:]
        try:
            sender.verify(tampered)
            out["mismatch_error"] = None
        except WeightSyncError as e:
            out["mismatch_error"] = str(e)
        out["tampered_name"] = name

        # engines receive in place: an update that fails after its broadcasts (a name the
        # model lacks) leaves a mix of versions, and generation is refused until a full update
        bogus = second + [("model.no_such_weight", torch.zeros(3))]
        try:
            sender.send(bogus, version="bogus")
            out["bogus_error"] = None
        except WeightSyncError as e:
            out["bogus_error"] = str(e)
        # the sender fails on the first engine's error; engine 0 may still be in its update,
        # and a request queued behind it on the paused engine waits for the resend (as on
        # SGLang), so ask once engine 0 has failed too (seen on a loaded machine: 60 s timeout)
        deadline = time.monotonic() + 60
        while not clients[0].server_info().get("partial_weights"):
            assert time.monotonic() < deadline, "engine 0 never recorded the failed update"
            time.sleep(0.05)
        try:
            clients[0].generate(PROMPTS, GREEDY)
            out["generate_after_bogus"] = None
        except Exception as e:  # noqa: BLE001 - the engine's refusal, whatever its type
            out["generate_after_bogus"] = f"{type(e).__name__}: {e}"
        # the export as the trainer streams it (trainer/export.py sync_share): read bucket
        # by bucket, never all held, and checked by the digests the send took
        export, digests = Export(second), []
        sender.send(iter(export), version="3", digests=digests)
        sender.verify(digests=digests)
        out["stream"] = {"most_alive": export.most_alive, "total": export.total,
                         "largest": max(t.numel() * t.element_size() for _, t in second),
                         "bucket": int(0.02 * 2**20), "digests": len(digests)}
        out["gen_versions3"] = [r.weight_version for c in clients
                                for r in c.generate(PROMPTS, GREEDY)]
    finally:
        sender.close()
        for c in clients:
            c.close()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--engines", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--load-format", default=None, help="null or flattened_bucket")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)  # the trainer's own group works before the weight group exists
    result = run_rank0(args) if rank == 0 else None
    t = torch.ones(1)
    dist.all_reduce(t)  # ... and after it
    if rank == 0:
        result["default_group_ok"] = t.item() == dist.get_world_size()
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
