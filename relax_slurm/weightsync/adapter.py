"""A LoRA adapter as a weight sync sends it (model.lora, docs/lora.md): PEFT's adapter config and
tensors, carried in the body of SGLang's /load_lora_adapter_from_tensors.

The wire form is SGLang's: `serialized_named_tensors` holds, per TP rank, a pickle of
{name: tensor} that its tp workers read with their restricted unpickler (SafeUnpickler). A
plain pickle of CPU tensors carries their bytes by value (`torch.storage._load_from_bytes`,
which SGLang reads back with torch.load(weights_only=True)), so it works from any host; the
shared-memory form SGLang's own Python engine sends (ForkingPickler) works on one host only.
The hf engine reads it with `read_tensors`, which allows the same few globals and no others.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass

import torch

from relax_slurm.errors import WeightSyncError


@dataclass(frozen=True)
class Adapter:
    """What an adapter-only sync sends: PEFT's adapter_config.json (`config`) and its tensors
    under PEFT's saved names (`base_model.model.<module>.lora_A.weight`, ...)."""

    config: dict
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def serialize_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """base64 of a by-value pickle of the tensors (contiguous CPU copies)."""
    plain = {n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()}
    return base64.b64encode(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)).decode()


def _load_storage(data: bytes):
    # what torch.storage._load_from_bytes does, without its unrestricted nested torch.load
    return torch.load(io.BytesIO(data), weights_only=True)


class _TensorUnpickler(pickle.Unpickler):
    """Only what a pickle of {name: CPU tensor} needs (as SGLang's SafeUnpickler allows)."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"),
               ("torch", "Size")}

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if (module, name) in self.ALLOWED:
            return OrderedDict if name == "OrderedDict" else super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in an adapter's "
                                     "tensors")


def read_tensors(payload: str | bytes) -> dict[str, torch.Tensor]:
    """`serialize_tensors`' output (base64 or raw pickle bytes) -> {name: tensor}."""
    raw = payload.encode() if isinstance(payload, str) else bytes(payload)
    if not (len(raw) >= 2 and raw[0] == 0x80):  # not a pickle yet: base64
        raw = base64.b64decode(raw, validate=True)
    try:
        out = _TensorUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, RuntimeError) as e:
        raise WeightSyncError(f"adapter tensors do not read: {e}") from e
    if not isinstance(out, dict) or not all(isinstance(t, torch.Tensor) for t in out.values()):
        raise WeightSyncError("adapter tensors: expected a map of names to tensors")
    return dict(out)
