"""Tensors handed to an engine on the same host by reference: the body of SGLang's
/update_weights_from_tensor (weight_sync.transport=tensor, docs/weight_sync.md#transports).

The engines of a colocated run share the trainer's GPUs (rollout.release_memory_during_train).
A weight-update group cannot hold them: NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"). SGLang's answer is /update_weights_from_tensor: the sender pickles the tensors
with torch's ForkingPickler, which writes a CUDA IPC handle for a GPU tensor (a shared-memory
file name for a CPU one) instead of its bytes, and the engine's tp workers open the handles
and copy the weights in. What travels over HTTP is a few hundred bytes per tensor.

Two details make it work across unrelated processes:
- GPU: the handle names its device by UUID, not by index (SGLang's own sender patch,
  srt/utils/patch_torch.py): the engine numbers GPUs by its own CUDA_VISIBLE_DEVICES.
- CPU: torch's default sharing strategy passes a file descriptor through a socket that
  checks the sender's multiprocessing authkey, which an engine started by the launcher does
  not share (SGLang's scheduler dies on "digest sent was rejected"). The "file_system"
  strategy names a /dev/shm file instead; it is set only while pickling.

`read_payload` is the hf engine's reader: the globals SGLang's SafeUnpickler allows for these
payloads and no others.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import threading
import types
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch
import torch.multiprocessing as torch_mp  # registers torch's reducers with ForkingPickler
from torch.multiprocessing import reductions

from relax_slurm.config.weight_sync import FLATTENED_BUCKET
from relax_slurm.errors import WeightSyncError
from relax_slurm.weightsync.bucket import flatten_bucket, tensor_nbytes, unflatten_bucket

_DEVICE_ARG = 6
"""Index of the device in the arguments of torch's rebuild_cuda_tensor (SGLang's constant:
the signature has not changed for years)."""
_strategy_lock = threading.Lock()


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_index(device: int | str) -> int:
    """A CUDA device by index (as sent by an unpatched sender) or by UUID."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == device:
            return index
    raise WeightSyncError(f"a tensor on GPU {device}, which this engine does not see: the "
                          "tensor transport needs the engine on the sender's GPUs' node")


def _reduce_tensor(t: torch.Tensor):
    fn, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        args = (*args[:_DEVICE_ARG], _device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return fn, args


class _Pickler(ForkingPickler):
    def __init__(self, file) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.dispatch_table[torch.Tensor] = _reduce_tensor
        self.dispatch_table[torch.nn.Parameter] = _reduce_tensor


@contextlib.contextmanager
def _file_system_sharing():
    with _strategy_lock:
        before = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch_mp.set_sharing_strategy(before)


def serialize(obj: Any) -> str:
    """base64 of obj pickled by reference (the sender keeps the tensors alive until the engine
    answered). Once per engine TP rank: a pickle counts one reference on the sender side."""
    buf = io.BytesIO()
    with _file_system_sharing():
        _Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def bucket_payload(bucket: Sequence[tuple[str, torch.Tensor]], load_format: Optional[str]
                   ) -> tuple[Any, list[torch.Tensor]]:
    """(what to pickle, the tensors it references: keep them until the engines answered).

    load_format None: [(name, tensor), ...]. flattened_bucket: one uint8 tensor of the
    bucket's bytes end to end and its layout ({"flattened_tensor", "metadata"}, SGLang's
    FlattenedTensorBucket fields, the metadata as SimpleNamespace, which its unpickler allows):
    one handle per bucket instead of one per tensor. A bucket has one dtype (bucket.py), so
    every tensor's offset is aligned to its size.

    CPU tensors are copied into one fresh buffer first: pickled as they are they would be
    moved into shared memory in place, the trainer's own parameters among them."""
    tensors = [t.detach().contiguous() for _, t in bucket]
    on_cpu = tensors[0].device.type == "cpu"
    if load_format == FLATTENED_BUCKET or on_cpu:
        flat = flatten_bucket(tensors)
        if on_cpu and flat.untyped_storage().data_ptr() in {
                t.untyped_storage().data_ptr() for t in tensors}:
            flat = flat.clone()  # a view of the parameters themselves (laid end to end)
        if load_format == FLATTENED_BUCKET:
            metadata, start = [], 0
            for (name, _), t in zip(bucket, tensors):
                n = tensor_nbytes(t)
                metadata.append(types.SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype,
                                                      start_idx=start, end_idx=start + n,
                                                      numel=n))
                start += n
            return {"flattened_tensor": flat, "metadata": metadata}, [flat]
        tensors = unflatten_bucket(flat, [t.dtype for t in tensors],
                                   [t.shape for t in tensors])
    return [(name, t) for (name, _), t in zip(bucket, tensors)], tensors


class _PayloadUnpickler(pickle.Unpickler):
    """What a payload of `serialize` needs (SGLang's SafeUnpickler allows these too), nothing
    else: the route takes a pickle from the network (behind the engine's API key)."""

    ALLOWED = {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"),
        ("types", "SimpleNamespace"), ("collections", "OrderedDict"),
        ("builtins", "list"), ("builtins", "tuple"), ("builtins", "dict"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in "
                                     "/update_weights_from_tensor's payload")


def _rebuild_cuda_tensor(*args):
    args = (*args[:_DEVICE_ARG], _device_index(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return reductions.rebuild_cuda_tensor(*args)


def read_payload(payload: str | bytes) -> Any:
    """`serialize`'s output (base64 or raw) -> the object, its tensors opened by reference."""
    raw = payload.encode() if isinstance(payload, str) else bytes(payload)
    if not (len(raw) >= 2 and raw[0] == 0x80):  # not a pickle yet: base64
        raw = base64.b64decode(raw, validate=True)
    try:
        return _PayloadUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, RuntimeError, OSError) as e:
        raise WeightSyncError(f"/update_weights_from_tensor: the payload does not read: {e} "
                              "(tensors by reference reach engines on the sender's host only)"
                              ) from e


def named_tensors(obj: Any, load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
    """A read payload -> (name, tensor) pairs (views of a flattened bucket)."""
    if load_format == FLATTENED_BUCKET:
        if not (isinstance(obj, dict) and {"flattened_tensor", "metadata"} <= set(obj)):
            raise WeightSyncError("load_format=flattened_bucket: the payload must be "
                                  "{'flattened_tensor', 'metadata'}")
        flat = obj["flattened_tensor"]
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                for m in obj["metadata"]]
    if not (isinstance(obj, (list, tuple))
            and all(isinstance(p, (list, tuple)) and len(p) == 2
                    and isinstance(p[1], torch.Tensor) for p in obj)):
        raise WeightSyncError("/update_weights_from_tensor: the payload must be a list of "
                              "(name, tensor) pairs")
    return [(str(n), t) for n, t in obj]
