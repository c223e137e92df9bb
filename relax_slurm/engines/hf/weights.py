"""The hf engine's weight updates (HFEngine's half that SGLang's weight routes reach): the
update session, a group's broadcast or shared tensors loaded into the parameters, LoRA adapters
and the version label, each under the model lock that generation holds between batches, as
SGLang's scheduler applies an update between its forward passes."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

import torch

from relax_slurm.engines import sglang_api
from relax_slurm.engines.hf.parsing import BadRequest
from relax_slurm.errors import WeightSyncError
from relax_slurm.weightsync.receiver import load_named_tensors, model_checksums, weight_targets

log = logging.getLogger("relax_slurm.hf_engine")


class WeightUpdates:
    """Mixed into HFEngine (core.py), whose state it reads: `_cond` and `state` (the session,
    partial_weights), `_model_lock`, `model`, `receiver`, `adapters`, `weight_version`,
    `sync_timeout_s`, `held_in_place()`."""

    def begin_session(self) -> None:
        """/begin_weight_update: updates are refused outside a session, as in SGLang 0.5.21+
        (which has no owner or timeout for one either)."""
        with self._cond:
            if self.state.session:
                raise BadRequest("a weight-update session is already open; call "
                                 "end_weight_update() first")
            self.state.session = True

    def end_session(self) -> None:
        with self._cond:
            if not self.state.session:
                raise BadRequest("no weight-update session is open; call "
                                 "begin_weight_update() first")
            self.state.session = False

    def update_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                       group_name: str, weight_version: Optional[str], flush_cache: bool,
                       flattened: bool = False) -> None:
        """Receive (per-tensor broadcast from rank 0, in the order of names; or one of the
        flattened bucket) and load. As SGLang 0.5.22+: refused outside a session (before
        anything is received), and a flush with requests paused in place fails after the
        weights are loaded."""
        with self._cond:
            if not self.state.session:
                raise BadRequest(sglang_api.OUT_OF_SESSION)
        if not self.receiver.has_group(group_name):
            raise BadRequest(f"no weight-update group {group_name!r}: call "
                             "/init_weights_update_group")
        t0 = time.monotonic()
        if not self._model_lock.acquire(timeout=self.sync_timeout_s):
            raise WeightSyncError(f"generation held the model for more than {self.sync_timeout_s}s")
        t_lock = t_received = time.monotonic()
        try:
            # received in place into the parameters: a failure midway leaves a mix of two
            # versions, so the engine serves nothing until a later update completes (requests
            # queued meanwhile are refused by _run_batch; the lock keeps them out until then)
            params = weight_targets(self.model)  # per-expert names too: views of fused experts
            with self._replacing(weight_version):
                received = self.receiver.receive(names, dtypes, shapes, group_name, self.device,
                                                 into=params, flattened=flattened)
                t_received = time.monotonic()
                load_named_tensors(self.model, received, adopt=flattened)
        finally:
            self._model_lock.release()
        t_end = time.monotonic()
        # the phases are what docs/benchmarks.md's weight-sync profile reads from this line
        log.info("loaded %d tensors from group %r (weight_version %s) in %.4fs: lock %.4fs, "
                 "receive %.4fs, load %.4fs", len(names), group_name, self.weight_version,
                 t_end - t0, t_lock - t0, t_received - t_lock, t_end - t_received)
        if flush_cache and self.held_in_place():
            raise BadRequest(sglang_api.FLUSH_REFUSED)

    def update_weights_from_tensor(self, named: list[tuple[str, torch.Tensor]],
                                   weight_version: Optional[str], flush_cache: bool) -> None:
        """/update_weights_from_tensor: tensors the sender shares by reference
        (weightsync/ipc.py, opened by the route), copied into the parameters. Refused outside
        a session, as SGLang does."""
        with self._cond:
            if not self.state.session:
                raise BadRequest(sglang_api.OUT_OF_SESSION)
        t0 = time.monotonic()
        with self._locked("loading weights from tensors"), self._replacing(weight_version):
            load_named_tensors(self.model, named)
        log.info("loaded %d tensors by reference (weight_version %s) in %.4fs", len(named),
                 self.weight_version, time.monotonic() - t0)
        if flush_cache and self.held_in_place():
            raise BadRequest(sglang_api.FLUSH_REFUSED)

    def load_adapter(self, name: str, config: dict, tensors: dict) -> None:
        """/load_lora_adapter_from_tensors, between generation batches."""
        with self._locked("loading an adapter"):
            self.adapters.load(name, config, tensors)
        log.info("loaded LoRA adapter %r (%d tensors)", name, len(tensors))

    def unload_adapter(self, name: str) -> None:
        """/unload_lora_adapter, once the batch in flight (which may use it) is done."""
        with self._locked("unloading an adapter"):
            self.adapters.unload(name)

    def set_weight_version(self, version: str) -> None:
        """/update_weight_version: what the weights served from now on are labelled."""
        with self._locked("setting the weight version"):
            self.weight_version = str(version)

    @contextlib.contextmanager
    def _replacing(self, weight_version: Optional[str]):
        """Around loading new weights into the parameters (model lock held): a failure midway
        leaves a mix of two versions, so the engine serves nothing (partial_weights) until a
        later update completes; a complete one takes `weight_version` as its label."""
        try:
            yield
        except BaseException:
            self.state.partial_weights = True
            raise
        self.state.partial_weights = False
        if weight_version is not None:
            self.weight_version = str(weight_version)

    @contextlib.contextmanager
    def _locked(self, what: str):
        if not self._model_lock.acquire(timeout=self.sync_timeout_s):
            raise WeightSyncError(f"{what}: generation held the model for more than "
                                  f"{self.sync_timeout_s}s")
        try:
            yield
        finally:
            self._model_lock.release()

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> None:
        """/init_weights_update_group: join the trainer's group (blocks until it forms)."""
        self.receiver.init_group(master_address, master_port, rank_offset, world_size,
                                 group_name, backend)

    def destroy_group(self, group_name: str) -> bool:
        """/destroy_weights_update_group, once no update holds the model (one the trainer gave
        up midway drops out within a second of its next cohort forming)."""
        if not self._model_lock.acquire(timeout=self.sync_timeout_s):
            raise WeightSyncError(f"an update held the model for more than {self.sync_timeout_s}s")
        try:
            return self.receiver.destroy_group(group_name)
        finally:
            self._model_lock.release()

    def checksums(self) -> dict[str, str]:
        with self._model_lock:
            return model_checksums(self.model)

