"""The engine side of weight sync, used by the hf engine server.

Mirrors what an SGLang server does for `/init_weights_update_group` and
`/update_weights_from_distributed`: join the named group at rank `rank_offset`, then for a
request (names, dtypes, shapes) allocate one empty tensor per name and receive it by a broadcast
from group rank 0, in the order of `names` (each received before the next is posted), and load
them; with load_format=flattened_bucket, one broadcast of all their bytes end to end.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from datetime import timedelta
from typing import Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from relax_slurm.errors import WeightSyncError
from relax_slurm.modeling import checkpoint_names, checkpoint_views
from relax_slurm.weightsync.bucket import consecutive_region, flat_nbytes, unflatten_bucket
from relax_slurm.weightsync.group import destroy_weight_update_group, init_weight_update_group

log = logging.getLogger(__name__)
RECHECK_S = 1.0  # how often a pending receive looks whether a newer group overtook it
PEFT_BASE = ".base_layer."
"""Where PEFT keeps a wrapped layer's own parameters (peft.tuners.lora.LoraLayer)."""


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (SGLang uses getattr(torch, name))."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use a torch dtype name such as bfloat16")
    return dtype


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (row-major, contiguous), as hex."""
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy()).hexdigest()  # the buffer itself: no copy to bytes


def parameter_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name (tied ones under each name), and fused MoE experts also per
    expert, as the checkpoint files and SGLang name them (`relax_slurm.modeling.
    checkpoint_views`: views into the fused tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = p
        out.update(checkpoint_views(name, p))
        if PEFT_BASE in name:
            # an engine serving LoRA adapters (PEFT wraps each targeted layer, its weight now
            # `...q_proj.base_layer.weight`) still takes the base weights under their own
            # names, as SGLang with --enable-lora does
            out.setdefault(name.replace(PEFT_BASE, "."), p)
    params = dict(model.named_parameters(remove_duplicate=False))
    for file_name, name in checkpoint_names(model).items():
        out.setdefault(file_name, out[name])
        for view_name, view in checkpoint_views(file_name, params[name]):
            out.setdefault(view_name, view)  # fused experts under a renamed stem (Qwen3-Omni)
    return out


def weight_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What an update may name: `parameter_views` and the buffers."""
    return {**parameter_views(model), **dict(model.named_buffers(remove_duplicate=False))}


def model_checksums(model: torch.nn.Module) -> dict[str, str]:
    """sha256 per name of `parameter_views`."""
    return {name: tensor_sha256(p) for name, p in parameter_views(model).items()}


def load_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]],
                       adopt: bool = False) -> None:
    """Copy tensors into the model's parameters/buffers by name: all checked first, then copied.

    Tied weights (lm_head.weight is embed_tokens.weight) are one tensor, so either name works.
    `adopt`: the tensors are views of a buffer nobody else holds (a received flattened
    bucket); when every name is a distinct parameter of the same dtype and device, each
    parameter takes its view as its storage instead of a copy. The bucket's buffer then is
    those parameters' memory, laid end to end in the bucket's order, so the next flattened
    bucket of the same names is received straight into them (WeightReceiver.receive).
    """
    targets = weight_targets(model)
    named = list(named)
    for name, t in named:
        if name not in targets:
            raise ValueError(f"unknown parameter {name!r}: the engine's model has no such name "
                             "(send Hugging Face parameter names)")
        if tuple(targets[name].shape) != tuple(t.shape):
            raise ValueError(f"parameter {name!r}: shape {tuple(t.shape)} sent, engine has "
                             f"{tuple(targets[name].shape)}")
    if adopt and _adoptable(targets, named):
        for name, t in named:
            targets[name].data = t
        return
    with torch.no_grad():
        for name, t in named:
            # received in place (WeightReceiver.receive's `into`): nothing to copy
            if t.data_ptr() != targets[name].data_ptr():
                targets[name].copy_(t)


def _adoptable(targets: Mapping[str, torch.Tensor],
               named: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Every name a distinct parameter (not a per-expert view of one, whose parameter would
    lose the view's update if it were rebound first; not tied to another name of the
    bucket) whose dtype and device the tensor has."""
    params = [targets[name] for name, _ in named]
    return (len({id(p) for p in params}) == len(params)
            and all(isinstance(p, torch.nn.Parameter) and p.dtype == t.dtype
                    and p.device == t.device for p, (_, t) in zip(params, named)))


def _in_place(target: Optional[torch.Tensor], dtype: torch.dtype, shape: Sequence[int],
              device: torch.device) -> Optional[torch.Tensor]:
    if (target is None or target.dtype != dtype or tuple(target.shape) != tuple(shape)
            or target.device != device or not target.is_contiguous()):
        return None
    return target.data


class WeightReceiver:
    """Named weight-update groups of one engine process, and receiving tensors on them."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._lock = threading.Lock()
        self._formed = 0  # groups formed so far: a receive started before a newer one is over
        self._backends: dict[str, str] = {}

    def group_names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def has_group(self, group_name: str) -> bool:
        with self._lock:
            return group_name in self._groups

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> None:
        """Join `group_name` as rank `rank_offset` (one rank per engine: tp_size 1)."""
        self.destroy_group(group_name)  # a new cohort under an old name replaces it
        pg = init_weight_update_group(master_address, master_port, rank_offset, world_size,
                                      group_name, backend, self.timeout_s)
        with self._lock:
            self._groups[group_name] = pg
            self._backends[group_name] = backend
            self._formed += 1

    def destroy_group(self, group_name: str) -> bool:
        with self._lock:
            pg = self._groups.pop(group_name, None)
            self._backends.pop(group_name, None)
        destroy_weight_update_group(pg)
        return pg is not None

    def receive(self, names: Sequence[str], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int]], group_name: str, device: torch.device,
                into: Optional[Mapping[str, torch.Tensor]] = None, flattened: bool = False
                ) -> list[tuple[str, torch.Tensor]]:
        """One broadcast from group rank 0 per name, in order; returns (name, tensor) pairs.
        `flattened` (load_format=flattened_bucket): one broadcast of all their bytes end to end
        (weightsync/bucket.py), returned as views of that buffer.

        A tensor of `into` with the same name, dtype, shape and device (and contiguous) is
        received in place: no new allocation and no second copy, which is most of the cost of
        a large sync on CPU (the benchmark measured 45% of raw broadcast bandwidth with a
        fresh buffer plus a copy per tensor). The caller must keep readers of `into` out
        until the receive is done (the engine holds its model lock). A flattened bucket is
        received in place when its targets lie end to end in `into` (see load_named_tensors'
        `adopt`), else into a new buffer.

        On gloo, a receive that a newer group (the trainer's next cohort) overtakes is
        abandoned with WeightSyncError within RECHECK_S: its sender failed midway (another
        engine of the cohort died) and will send nothing more on the old group, and waiting
        out timeout_s would hold the engine's model lock against the new cohort's update all
        that time.
        """
        with self._lock:
            pg = self._groups.get(group_name)
            formed = self._formed
            # gloo's wait can time out and be waited again; NCCL's timeout aborts the
            # communicator (its watchdog), so there it is one wait of timeout_s as before
            recheck = RECHECK_S if self._backends.get(group_name) == "gloo" else self.timeout_s
        if pg is None:
            raise WeightSyncError(f"no weight-update group {group_name!r}: call "
                                  "/init_weights_update_group first")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        into = into or {}
        if flattened:
            # the targets already laid end to end in the bucket's order (a previous flattened
            # bucket's buffer that load_named_tensors(adopt=True) made their storage): receive
            # straight into them; otherwise into a new buffer that the parameters then adopt
            targets = [_in_place(into.get(n), d, s, device)
                       for n, d, s in zip(names, torch_dtypes, shapes)]
            flat = None if any(t is None for t in targets) else consecutive_region(targets)
            if flat is None:
                flat = torch.empty(flat_nbytes(torch_dtypes, shapes), dtype=torch.uint8,
                                   device=device)
            what = f"a flattened bucket of {len(names)} tensors ({names[0]!r}...)"
            self._wait_all([(what, dist.broadcast(flat, src=0, group=pg, async_op=True))],
                           group_name, formed, recheck)
            return list(zip(names, unflatten_bucket(flat, torch_dtypes, shapes)))
        received = []
        deadline = time.monotonic() + self.timeout_s  # for the whole request, as flattened
        for name, dtype, shape in zip(names, torch_dtypes, shapes):
            t = _in_place(into.get(name), dtype, shape, device)
            if t is None:
                t = torch.empty(list(shape), dtype=dtype, device=device)
            # each received before the next is posted (the sender still issues them all at
            # once): on gloo with the two processes on cores of their own, receives posted
            # all together completed ~1 ms apart each (24 small tensors: 24 ms against 5 one
            # after another; 79 of 6 MB: 0.20 s against 0.13 s, raw). The tiny model's sync
            # per tensor 31 -> 16 ms, the 448 MB one's 0.24 -> 0.16 s (docs/benchmarks.md)
            work = dist.broadcast(t, src=0, group=pg, async_op=True)
            self._wait_all([(repr(name), work)], group_name, formed, recheck, deadline)
            received.append((name, t))
        return received

    def _wait_all(self, works: list[tuple[str, dist.Work]], group_name: str, formed: int,
                  recheck: float, deadline: float | None = None) -> None:
        """Wait for `works` in turn until `deadline` (default: timeout_s from now)."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        for what, work in works:
            while not self._wait(work, what, group_name, deadline, recheck):
                if self._formed != formed:
                    raise WeightSyncError(
                        f"receiving {what} on group {group_name!r} abandoned: a newer "
                        "weight-update group was formed (the sender gave this one up)")

    def _wait(self, work: dist.Work, what: str, group_name: str, deadline: float,
              recheck: float) -> bool:
        """Wait for `work` up to `recheck` seconds: True when done, False when not yet; raises
        on failure and past `deadline`."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise WeightSyncError(f"receiving {what} on group {group_name!r} timed out "
                                  f"after {self.timeout_s}s")
        try:
            ok = work.wait(timeout=timedelta(seconds=min(recheck, left)))
        except Exception as e:  # gloo raises on its timeout too: a timed-out wait can be retried
            if work.is_completed() or "timed out" not in str(e).lower():
                raise WeightSyncError(f"receiving {what} on group {group_name!r} failed: "
                                      f"{e}") from e
            return False
        return ok is not False
