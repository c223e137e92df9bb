"""Flattened buckets received over a real gloo group (rank 0 a child process, rank 1 this one):
the parameters adopt the first bucket's buffer, later buckets of the same names arrive straight
into them, and every sync is bit-exact, over several syncs of mixed dtypes and sizes with the
sender's kept buffer growing and shrinking between buckets, and per-tensor syncs in between."""

import os
import subprocess
import sys

import pytest
import torch

from relax_slurm.weightsync.bucket import (FlatBuffer, bucket_named_tensors, consecutive_region,
                                           dtype_name)

GROUP = "flat_receive_test"
SPECS = [("a", (300, 7), torch.float32), ("b", (5,), torch.bfloat16),
         ("c", (64, 64), torch.float32), ("d", (3, 3, 3), torch.float16),
         ("e", (1000,), torch.bfloat16), ("f", (2,), torch.float32), ("g", (40, 9), torch.float16)]
BUCKET_MB = 0.01  # 10 KiB: "c" (16 KiB) goes alone, the others share buckets of varied sizes
SYNCS = ["flattened_bucket", "flattened_bucket", None, "flattened_bucket", None]


def state(k: int) -> list[tuple[str, torch.Tensor]]:
    """Sync k's weights: other values every sync (raw bits, so no NaN rule interferes)."""
    g = torch.Generator().manual_seed(k)
    return [(name, torch.randn(shape, generator=g).to(dtype)) for name, shape, dtype in SPECS]


def buckets(k: int) -> list[list[tuple[str, torch.Tensor]]]:
    return bucket_named_tensors(state(k), BUCKET_MB)


def sender(port: int) -> None:
    """Rank 0: what WeightSender._send_bucket broadcasts, in each sync's format."""
    import torch.distributed as dist

    from relax_slurm.weightsync.group import destroy_weight_update_group, init_weight_update_group
    pg = init_weight_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", 60)
    flat = FlatBuffer()
    for k, fmt in enumerate(SYNCS):
        for bucket in buckets(k):
            tensors = [t for _, t in bucket]
            payload = [flat.flatten(tensors)] if fmt else tensors
            for t in payload:
                dist.broadcast(t, src=0, group=pg)
    sys.stdin.read()  # until the receiver has it all: a group torn down under a receive fails
    destroy_weight_update_group(pg)
    os._exit(0)  # as the run's roles (runtime/exit.py): gloo's threads abort a normal exit


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.timeout(120)
def test_flattened_buckets_land_in_the_adopted_parameters_bit_exact():
    from relax_slurm.weightsync.receiver import (WeightReceiver, load_named_tensors,
                                                 weight_targets)
    from tests.helpers_tiny import REPO_ROOT, child_env, free_port

    model = torch.nn.Module()
    for name, shape, dtype in SPECS:
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype),
                                                          requires_grad=False))
    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, str(port)], env=child_env(),
                             cwd=REPO_ROOT, start_new_session=True, stdin=subprocess.PIPE)
    receiver = WeightReceiver(timeout_s=60)
    try:
        receiver.init_group("127.0.0.1", port, 1, 2, GROUP, "gloo")
        adopted: dict[str, int] = {}
        for k, fmt in enumerate(SYNCS):
            for bucket in buckets(k):
                names = [n for n, _ in bucket]
                received = receiver.receive(
                    names, [dtype_name(t.dtype) for _, t in bucket],
                    [list(t.shape) for _, t in bucket], GROUP, torch.device("cpu"),
                    into=weight_targets(model), flattened=fmt is not None)
                load_named_tensors(model, received, adopt=fmt is not None)
                params = [model.get_parameter(n) for n in names]
                if fmt:  # the bucket's parameters lie end to end, in its order
                    assert consecutive_region(params) is not None
            ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
            if adopted:  # since the first flattened bucket: received in place, every format
                assert ptrs == adopted
            elif fmt:
                adopted = ptrs
            for name, want in state(k):
                got = model.get_parameter(name)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(_bits(got), _bits(want)), (k, name)
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    finally:
        receiver.destroy_group(GROUP)
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_bucket_naming_one_parameter_twice_is_copied_not_adopted():
    """Tied weights sent under both names: rebinding one name's view would leave the other's
    update out, so the bucket is copied into the parameter (the tie stays one tensor)."""
    from relax_slurm.weightsync.bucket import flatten_bucket, unflatten_bucket
    from relax_slurm.weightsync.receiver import load_named_tensors

    model = torch.nn.Module()
    model.emb, model.head = torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(3, 4, bias=False)
    model.head.weight = model.emb.weight
    before = model.emb.weight.data_ptr()
    sent = [("emb.weight", torch.randn(4, 3)), ("head.weight", torch.randn(4, 3))]
    views = unflatten_bucket(flatten_bucket([t for _, t in sent]), [torch.float32] * 2,
                             [[4, 3]] * 2)
    load_named_tensors(model, list(zip([n for n, _ in sent], views)), adopt=True)
    assert model.head.weight is model.emb.weight and model.emb.weight.data_ptr() == before
    assert torch.equal(_bits(model.emb.weight), _bits(sent[1][1]))  # the last one, as copied


if __name__ == "__main__":
    sender(int(sys.argv[1]))
