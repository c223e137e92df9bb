"""Weight sync from trainer rank 0 to inference engines over a dedicated process group.

group.py (form/destroy the group as SGLang does), bucket.py (pure bucketing), sender.py
(trainer side), receiver.py (engine side, used by the hf engine); tensor_sender.py and ipc.py:
buckets by reference to engines sharing the trainer's GPUs (weight_sync.transport=tensor).
See docs/weight_sync.md.
"""

from relax_slurm.weightsync.bucket import bucket_named_tensors, dtype_name
from relax_slurm.weightsync.group import (destroy_weight_update_group, init_weight_update_group,
                                          resolve_backend)
from relax_slurm.weightsync.receiver import tensor_sha256
from relax_slurm.weightsync.sender import WeightSender

__all__ = ["WeightSender", "bucket_named_tensors", "destroy_weight_update_group", "dtype_name",
           "init_weight_update_group", "resolve_backend", "tensor_sha256"]
