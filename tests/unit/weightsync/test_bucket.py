import pytest
import torch

from relax_slurm.weightsync.bucket import (bucket_named_tensors, consecutive_region, dtype_name,
                                           flat_nbytes, flatten_bucket, unflatten_bucket)

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


def test_a_flattened_bucket_is_the_bytes_end_to_end_and_comes_back_exact():
    ts = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.arange(3),
          torch.randn(2, 2).t()]  # non-contiguous: its row-major bytes
    flat = flatten_bucket(ts)
    # SGLang's FlattenedTensorBucket layout: each tensor's flatten().view(uint8), in order
    assert flat.dtype == torch.uint8
    assert flat.numel() == flat_nbytes([t.dtype for t in ts], [t.shape for t in ts]) == 98
    assert torch.equal(flat[:48], ts[0].reshape(-1).view(torch.uint8))
    back = unflatten_bucket(flat, [t.dtype for t in ts], [t.shape for t in ts])
    for t, b in zip(ts, back):
        assert b.dtype == t.dtype and torch.equal(b, t)  # the int64 one sits at an odd offset
    with pytest.raises(ValueError, match="announced"):
        unflatten_bucket(flat[:-1], [t.dtype for t in ts], [t.shape for t in ts])


def test_flattening_into_a_kept_buffer_writes_its_first_bytes_and_reuses_it():
    buf = torch.full((200,), 7, dtype=torch.uint8)
    for ts in ([torch.randn(3, 4), torch.randn(5)],                  # 68 bytes
               [torch.randn(2, 2).t(), torch.randn(30)],             # 136: non-contiguous first
               [torch.randn(5).to(torch.bfloat16), torch.arange(2)]):  # 26
        flat = flatten_bucket(ts, out=buf)
        assert flat.data_ptr() == buf.data_ptr() and torch.equal(flat, flatten_bucket(ts))
        assert torch.equal(buf[:flat.numel()], flatten_bucket(ts))
    one = torch.randn(6)  # a bucket of one contiguous tensor is that tensor's bytes: no copy
    assert flatten_bucket([one], out=buf).data_ptr() == one.data_ptr()


def test_tensors_laid_end_to_end_are_their_own_flattened_bucket():
    storage = torch.arange(64, dtype=torch.uint8)
    a, b, c = storage[8:24].view(torch.float32), storage[24:32].view(torch.float32), \
        storage[32:48].view(torch.float32).reshape(2, 2)
    region = consecutive_region([a, b, c])
    assert region is not None and region.data_ptr() == a.data_ptr()
    assert torch.equal(region, storage[8:48])
    assert flatten_bucket([a, b, c]).data_ptr() == a.data_ptr()  # no copy
    region[:] = 1  # writing into the region writes into the tensors
    assert torch.equal(c.reshape(-1).view(torch.uint8), torch.ones(16, dtype=torch.uint8))
    # not in order, a gap, two storages, a non-contiguous tensor: no region
    assert consecutive_region([b, a]) is None
    assert consecutive_region([a, c]) is None
    assert consecutive_region([a, torch.zeros(2)]) is None
    t = torch.zeros(4, 4)
    assert consecutive_region([t.t()]) is None
    assert consecutive_region([t[:2], t[2:]]) is not None
