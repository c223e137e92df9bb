"""weight_sync.transport=tensor: trainer rank 0 hands each bucket to the engines on its own host
by reference, through SGLang's /update_weights_from_tensor (CUDA IPC handles on GPUs, shared
memory on CPU: weightsync/ipc.py), instead of broadcasting it over a weight-update group.

For engines that share the trainer's GPUs (rollout.release_memory_during_train), where an NCCL
group cannot form: it refuses two ranks on one GPU. The session, the pauses, the versions and
the failure handling are WeightSender's; only how a bucket travels differs, and there is no
group to form or destroy (the cohort's re-forming is then a check that every engine answers).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from relax_slurm.weightsync import ipc
from relax_slurm.weightsync.bucket import tensor_nbytes
from relax_slurm.weightsync.sender import WeightSender

log = logging.getLogger(__name__)


class TensorSender(WeightSender):
    """WeightSender whose buckets go by reference to engines on this host."""

    _connected = False

    @property
    def connected(self) -> bool:
        return self._connected

    def connect(self) -> None:
        """No group: every engine's protocol is checked, as before a group forms."""
        self.check_engines()
        self._connected = True
        log.info("weight sync by reference (/update_weights_from_tensor) to %d engines on "
                 "this host", len(self.clients))

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: Optional[str],
                     flush_cache: bool) -> tuple[int, int]:
        """(bytes, 0): the engines open the bucket's tensors and copy them in; the references
        are held here until every engine answered."""
        on_device = [(n, t.detach().to(self.device)) for n, t in bucket]
        obj, held = ipc.bucket_payload(on_device, self.load_format)
        # a payload per engine and TP rank: each pickle counts one reference on the sender
        # (CUDA IPC's producer-side refcount; SGLang's tp workers each read their own)
        self._join("/update_weights_from_tensor", self._on_engines(
            lambda c, i: c.update_weights_from_tensor(
                [ipc.serialize(obj) for _ in range(self.ranks_per_engine)], version,
                flush_cache, self.load_format)))
        del obj, held
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free what the engines have let go of
        return sum(tensor_nbytes(t) for _, t in on_device), 0

    def destroy_on_engines(self) -> None:
        """Nothing to destroy: no group was formed."""

    def close(self) -> None:
        self._connected = False
        self._release()
