"""weight_sync.transport (docs/weight_sync.md#transports): which way a bucket travels, the payload
of /update_weights_from_tensor (weightsync/ipc.py) and what the hf engine refuses to read.
Against the engines themselves: tests/integration/test_engine_contract.py."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from relax_slurm.config.weight_sync import resolve_transport
from relax_slurm.errors import ConfigError, WeightSyncError
from relax_slurm.launch.submit import compose_config
from relax_slurm.weightsync import ipc

SLURM = ["cluster=slurm", "run_dir=/tmp/relax-unit-run", "rollout=sglang",
         "cluster.gpus_per_node=8", "algo.max_staleness=0"]
SHARED_NODE = ["cluster.layout=colocated", "cluster.rollout_nodes=0", "cluster.trainer_nodes=1"]


def transport(*overrides: str) -> str:
    c = compose_config(["experiment=tiny_cpu", *overrides])
    return resolve_transport(c.weight_sync, c.rollout.release_memory_during_train, c.cluster)


def test_auto_sends_by_reference_exactly_when_engines_share_rank_0s_memory():
    assert transport() == "distributed"
    assert transport("rollout.release_memory_during_train=true",
                     "algo.max_staleness=0") == "tensor"  # a local run: one host
    assert transport(*SLURM, *SHARED_NODE, "rollout.release_memory_during_train=true") == "tensor"
    # engines on GPUs of their own, or on nodes of their own: the group
    assert transport(*SLURM, *SHARED_NODE, "trainer.nproc_per_node=4") == "distributed"
    assert transport(*SLURM, "rollout.release_memory_during_train=true") == "distributed"
    assert transport("weight_sync.transport=distributed", "algo.max_staleness=0",
                     "rollout.release_memory_during_train=true") == "distributed"


def test_by_reference_to_another_node_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"weight_sync\.transport=tensor .*trainer rank 0's "
                                          r"node .*cluster\.trainer_nodes=1"):
        compose_config(["experiment=tiny_cpu", *SLURM, "weight_sync.transport=tensor"])
    # shared GPUs on two trainer nodes: neither transport reaches every engine
    with pytest.raises(ConfigError, match=r"release_memory_during_train=true on 2 shared "
                                          r"trainer nodes.*cluster\.trainer_nodes=1"):
        compose_config(["experiment=tiny_cpu", *SLURM, "cluster.layout=colocated",
                        "cluster.rollout_nodes=0", "cluster.trainer_nodes=2",
                        "rollout.release_memory_during_train=true"])
    with pytest.raises(ConfigError, match=r"weight_sync\.transport='ipc'"):
        compose_config(["experiment=tiny_cpu", "weight_sync.transport=ipc"])


def named(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(3, 5, generator=g).to(dtype)),
            ("b.bias", torch.randn(7, generator=g).to(dtype)),
            ("c.weight", torch.randn(2, 2, 2, generator=g).to(dtype))]


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bucket_reads_back_whole_and_the_source_stays_private(load_format, dtype):
    bucket = named(dtype)
    obj, held = ipc.bucket_payload(bucket, load_format)
    back = ipc.named_tensors(ipc.read_payload(ipc.serialize(obj)), load_format)
    assert [n for n, _ in back] == [n for n, _ in bucket]
    for (_, a), (_, b) in zip(bucket, back):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # one shared buffer holds the bucket; the caller's tensors were copied, not moved
    assert all(t.is_shared() for t in held)
    assert not any(t.is_shared() for _, t in bucket)


def test_the_payload_reader_allows_tensors_and_nothing_else():
    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    with pytest.raises(WeightSyncError, match=r"global posix\.system is not allowed"):
        ipc.read_payload(evil)
    with pytest.raises(WeightSyncError, match=r"a list of \(name, tensor\) pairs"):
        ipc.named_tensors(ipc.read_payload(ipc.serialize({"a": 1})), None)
    with pytest.raises(WeightSyncError, match=r"'flattened_tensor', 'metadata'"):
        ipc.named_tensors(ipc.read_payload(ipc.serialize([("a", torch.ones(1))])),
                          "flattened_bucket")


def test_serializing_leaves_the_process_sharing_strategy_as_it_was():
    before = torch.multiprocessing.get_sharing_strategy()
    ipc.serialize([("a", torch.ones(2))])
    assert torch.multiprocessing.get_sharing_strategy() == before
