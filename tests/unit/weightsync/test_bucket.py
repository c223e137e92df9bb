import pytest
import torch

from relax_slurm.weightsync.bucket import bucket_named_tensors, dtype_name

MB = 1024 * 1024


def _t(nbytes: int, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)


def test_every_tensor_once_in_order_within_dtype():
    named = [(f"w{i}", _t(MB // 4)) for i in range(10)]
    buckets = bucket_named_tensors(named, bucket_mb=1)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert [len(b) for b in buckets] == [4, 4, 2]


def test_buckets_are_single_dtype_and_grouped_by_first_appearance():
    named = [("a", _t(100)), ("b", _t(100, torch.bfloat16)), ("c", _t(100)),
             ("d", _t(100, torch.bfloat16)), ("e", _t(100, torch.int64))]
    buckets = bucket_named_tensors(named, bucket_mb=1)
    assert [[n for n, _ in b] for b in buckets] == [["a", "c"], ["b", "d"], ["e"]]
    for b in buckets:
        assert len({t.dtype for _, t in b}) == 1


def test_large_tensor_gets_its_own_bucket():
    named = [("small", _t(MB // 2)), ("huge", _t(3 * MB)), ("tail", _t(MB // 2))]
    buckets = bucket_named_tensors(named, bucket_mb=1)
    assert [[n for n, _ in b] for b in buckets] == [["small"], ["huge"], ["tail"]]


def test_size_limit_respected_unless_single():
    named = [(f"w{i}", _t((i % 5 + 1) * 40_000)) for i in range(50)]
    for b in bucket_named_tensors(named, bucket_mb=0.5):
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 0.5 * MB or len(b) == 1


def test_empty_and_invalid():
    assert bucket_named_tensors([], bucket_mb=1) == []
    with pytest.raises(ValueError, match="bucket_mb"):
        bucket_named_tensors([("a", _t(4))], bucket_mb=0)


def test_dtype_name_is_what_sglang_resolves():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert getattr(torch, dtype_name(dt)) is dt
