"""Checkpoints of the megatron backend in Megatron's dist-checkpoint format (torch_dist).

    RUN_DIR/checkpoints/step_<N>/
        .metadata, __*.distcp, metadata.json, common.pt   Megatron dist-checkpoint: model and
                                                          optimizer, sharded by TP/PP/EP, which
                                                          reshards on load (other sizes); with
                                                          algo=ppo also the critic's (CRITIC);
                                                          the KL reference when
                                                          algo.ref_update_interval moves it
                                                          (megatron/reference.py PREFIX)
        rng/rank_<r>.pt                                   RNG states of rank r
        hf/                                               config.json, tokenizer (for relax-convert)
        meta.json                                         as the torch backend's, + "backend"

With model.lora the dist-checkpoint holds the adapters and their optimizer state only (the base
is model.path), and meta.json extra_state["lora"] the adapter's config and base (as trainer=torch).

The same atomic commit as the torch backend's DCP checkpoints (written as step_<N>.tmp/, meta.json
last, renamed): resume rules, `latest`, keep_last and pruning are shared (checkpoint/dcp.py).
An async save (`trainer.async_save`) commits the same way, only later: a crash while its
writer runs leaves step_<N>.tmp/ without meta.json, which is never taken for a checkpoint.
`relax-convert` recognises the format (metadata.json) and writes HF through the bridge.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from relax_slurm.checkpoint.from_lora import LORA_KEY
from relax_slurm.checkpoint.hf_files import copy_hf_assets, write_hf_stream
from relax_slurm.checkpoint.dcp import (
    HF_ASSETS, RNG_DIR, SAVE_TIMEOUT, SaveHandle, barrier, checkpoint_group, commit_checkpoint,
    meta_json, remove_leftovers, set_pending, wait_pending,
)
from relax_slurm.checkpoint.resume import META, CheckpointError, is_complete, step_dir_name
from relax_slurm.checkpoint.rng import load_rng, save_rng
from relax_slurm.trainer.megatron import omni
from relax_slurm.trainer.megatron.model import MegatronModel


class ShardedSide(Protocol):
    """A model kept beside the policy in its dist-checkpoint, no optimizer state: the moving
    KL reference (megatron/reference.py MegatronReference)."""

    def sharded_state_dict(self) -> dict: ...

    def load(self, state: dict) -> None: ...

log = logging.getLogger("relax_slurm.checkpoint")
BACKEND = "megatron"
LEGACY_REFERENCE = "reference.pt"
"""Where checkpoints kept the moving reference while it was a transformers replica (HF names);
it now lives in the dist-checkpoint, sharded (megatron/reference.py)."""


# the distributed optimizer's state in the canonical per-parameter layout (gathered on DP rank 0
# when saving), so its checkpoints reshard over any TP/PP/DP sizes and load with or without it;
# ignored by the plain optimizer
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


CRITIC = "critic."
"""algo=ppo: the critic's tensors are keyed as the policy's with this prefix in the same
dist-checkpoint ("critic.decoder.layers...", "critic.output_layer.weight" its value head;
its optimizer's "optimizer.state.exp_avg.critic...."); in the loaded state dict they sit under
"critic" and "critic_optimizer", as the torch backend's DCP keeps them."""


def sharded_state_dict(mm: MegatronModel, loading: bool = False,
                       critic: MegatronModel | None = None, adapter_only: bool = False,
                       reference: ShardedSide | None = None) -> dict:
    model_sd = model_sharded_state_dict(mm.chunks, adapter_only)
    state = {**model_sd, "optimizer": mm.optimizer.sharded_state_dict(
        model_sd, is_loading=loading, metadata=OPTIMIZER_METADATA)}
    if reference is not None:  # its keys prefixed (reference.PREFIX); no optimizer state
        state["reference"] = reference.sharded_state_dict()
    if critic is not None:
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        [(_, critic_sd)] = model_sharded_state_dict(critic.chunks).items()  # PP is refused
        # the checkpoint's keys prefixed, the state dict's own left as the module's (so it
        # loads back with load_state_dict); the optimizer keys its state by the model's keys
        replace_prefix_for_sharding(critic_sd, "", CRITIC)
        state["critic"] = critic_sd
        state["critic_optimizer"] = critic.optimizer.sharded_state_dict(
            critic_sd, is_loading=loading, metadata=OPTIMIZER_METADATA)
    return state


def model_sharded_state_dict(chunks, adapter_only: bool = False) -> dict:
    """Megatron-LM's layout: "model", or "model0", "model1", ... with virtual pipeline stages;
    keys of the bare GPTModel (no DDP "module." prefix), as the converter reads them.
    `adapter_only` (model.lora): the adapters' keys alone, as trainer=torch's LoRA checkpoints
    hold the trainable parameters only; the frozen base is model.path, loaded at build."""
    bare = [getattr(c, "module", c) for c in chunks]
    sds = [c.sharded_state_dict() for c in bare]
    if adapter_only:
        sds = [{k: v for k, v in sd.items() if ADAPTER_KEY in k} for sd in sds]
    if len(bare) == 1:
        return {"model": sds[0]}
    return {f"model{i}": sd for i, sd in enumerate(sds)}


ADAPTER_KEY = ".adapter."
"""What every key of a model.lora adapter has (megatron-bridge's AdapterWrapper.adapter)."""


def load_model_state(module, state: dict, adapter_only: bool) -> None:
    """The loaded state into a chunk: all of it, or with `adapter_only` every adapter and
    nothing else (the base stays model.path as built)."""
    if not adapter_only:
        module.load_state_dict(state)
        return
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if ADAPTER_KEY in k]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the checkpoint's adapter does not fit the model.lora built: "
                              f"missing {missing[:4]}, unexpected {result.unexpected_keys[:4]} "
                              "(model.lora.rank / target_modules must be the run's)")


def save(root: Path, step: int, mm: MegatronModel, extra_state: dict[str, Any], *,
         keep_last: int, hf_assets_src: str | None, async_save: bool = False,
         reference: ShardedSide | None = None, critic: MegatronModel | None = None,
         adapter_only: bool = False) -> SaveHandle:
    """Every rank calls this. Synchronous: returns once the checkpoint is committed. With
    `async_save`, returns once a forked process holds a snapshot of the state and writes it
    (megatron-core's async dist-checkpointing); the commit happens when the handle is waited
    for, on every rank (the next save, the end of the run: `dcp.wait_pending()`).
    `reference` (algo.ref_update_interval moves it) and `critic` (algo=ppo's, CRITIC) go in
    the same dist-checkpoint, sharded as the policy. `adapter_only`
    (model.lora): the policy's adapters and their optimizer state, not the frozen base."""
    from concurrent.futures import Future

    from megatron.core import dist_checkpointing

    if keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last}: keep at least 1 (trainer.keep_last)")
    wait_pending()  # at most one save in flight: the previous one commits first
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp"
    meta_text = _meta_text(step, {**extra_state, "step": step, "lr_steps_done": mm.steps_done,
                                  "reference_saved": reference is not None,
                                  "critic_saved": critic is not None})
    rank = dist.get_rank()
    group = checkpoint_group()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        tmp.mkdir()
        if hf_assets_src is not None:
            copy_hf_assets(hf_assets_src, tmp / HF_ASSETS, include_config=True)
    barrier(group)
    save_rng(tmp / RNG_DIR / f"rank_{rank}.pt")
    done: Future = Future()

    def commit() -> None:
        # every shard and megatron's metadata.json are on disk: meta.json last, then the rename
        barrier(group)
        if rank == 0:
            commit_checkpoint(root, tmp, final, meta_text, keep_last)
        barrier(group)
        done.set_result(final)

    _forked_results_queue()
    try:
        request = dist_checkpointing.save(
            sharded_state_dict(mm, critic=critic, adapter_only=adapter_only,
                               reference=reference),
            str(tmp), async_sharded_save=async_save)
    except Exception as e:
        raise CheckpointError(f"writing Megatron checkpoint step {step} to {tmp} failed: {e}"
                              ) from e
    if not async_save:
        commit()
        return SaveHandle(step, final, done)
    request.finalize_fns.append(commit)  # after megatron's own (write results, metadata.json)
    queue = _async_queue()
    queue.schedule_async_request(request)
    handle = SaveHandle(step, final, done, _finalize=lambda: _finalize_all(queue))
    set_pending(handle)
    return handle


def _meta_text(step: int, extra: dict[str, Any]) -> str:
    """meta.json's text: the shared fields, "backend", and the flags of what side models the
    checkpoint holds only where true (as before they existed)."""
    extra = {k: v for k, v in extra.items() if k not in ("reference_saved", "critic_saved") or v}
    return json.dumps({**json.loads(meta_json(step, extra)), "backend": BACKEND}, indent=2)


_QUEUE = None  # megatron-core's AsyncCallsQueue, one per process


def _as_spawned() -> None:
    """In the forked results manager: the signals a spawned process would have (the rank's
    stack-dump handler writes to the rank's file)."""
    import signal

    from relax_slurm.runtime.stacks import forget_stack_dumps

    forget_stack_dumps()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _forked_results_queue() -> None:
    """megatron-core's savers return their write results through a Manager's queue, whose
    process it starts with "spawn" (dist_checkpointing/strategies/filesystem_async.py
    `_get_write_results_queue`): a process that imports the rank's whole `__main__` again
    (relax_slurm.trainer: torch, transformers, megatron), ~2.5 CPU-s and a few seconds at
    every rank's first save. The queue only goes to this process and to the writers
    megatron forks (AsyncCallsQueue(persistent=False) forks too), so the same Manager,
    forked, serves it; set in the module's cache before megatron makes its own."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(_as_spawned)
        filesystem_async._results_queue = manager.Queue()


def _async_queue():
    """megatron-core's queue of async saves: each save forks a process that writes the state
    as it was at the fork (the parent trains on, copy-on-write keeps the snapshot)."""
    global _QUEUE
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if _QUEUE is None:
        _QUEUE = AsyncCallsQueue(persistent=False)
    return _QUEUE


def _finalize_all(queue, timeout_s: float = SAVE_TIMEOUT.total_seconds()) -> None:
    """Every rank: wait for the writer processes, then run the finalize functions (write
    results checked, metadata.json, our commit). Polls (each poll is one all-reduce, so the
    ranks stay in step) rather than joining, to give up after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while queue.get_num_unfinalized_calls():
        if queue.maybe_finalize_async_calls(blocking=False):
            continue
        if time.monotonic() > deadline:
            raise CheckpointError(f"the async checkpoint writer did not finish in {timeout_s:.0f}"
                                  " s; look for a full or slow disk, or set "
                                  "trainer.async_save=false")
        time.sleep(0.05)


def load(path: Path, mm: MegatronModel, reference: ShardedSide | None = None,
         critic: MegatronModel | None = None, adapter_only: bool = False) -> dict[str, Any]:
    """Load model, optimizer, lr position and this rank's RNG; returns extra_state (+ "step").
    `reference`: loaded when the checkpoint has one, else left as it is (model.path); likewise
    `critic` (model and optimizer) from its CRITIC keys."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (needs .metadata and {META})")
    meta = json.loads((path / META).read_text())
    if meta.get("backend") != BACKEND:
        raise CheckpointError(
            f"{path} was written by the torch backend (DCP), not trainer=megatron: resume it "
            "with trainer=torch, or convert it (relax-convert --to hf) and start a megatron run "
            "from the HF directory (model.path=..., resume=none)")
    extra = meta.get("extra_state", {})
    if critic is not None and not extra.get("critic_saved"):
        log.warning("%s holds no critic (saved by a run without one): the critic starts "
                    "fresh", path)
        critic = None
    if adapter_only and LORA_KEY not in extra:
        raise CheckpointError(f"{path} holds no LoRA adapter (a run without model.lora saved "
                              "it): resume it with model.lora.rank=0, or start this run fresh")
    if not adapter_only and LORA_KEY in extra:
        raise CheckpointError(f"{path} holds a model.lora adapter and no full weights: resume "
                              "it with the run's model.lora settings")
    if reference is not None and not extra.get("reference_saved"):
        log.warning("%s holds no reference model (saved without algo.ref_update_interval): "
                    "the reference stays model.path as loaded", path)
        reference = None
    if reference is not None and (path / LEGACY_REFERENCE).exists():
        raise CheckpointError(
            f"{path} keeps its moving KL reference in {LEGACY_REFERENCE}, a transformers "
            "replica's HF-named weights written before the megatron reference was sharded "
            "(docs/backends.md); this version cannot load it: resume it with the version that "
            "wrote it, or from model.path with resume=none")
    state = dist_checkpointing.load(sharded_state_dict(mm, loading=True, critic=critic,
                                                       adapter_only=adapter_only,
                                                       reference=reference), str(path))
    for i, chunk in enumerate(mm.chunks):
        load_model_state(chunk.module, state["model" if len(mm.chunks) == 1 else f"model{i}"],
                         adapter_only)
    mm.optimizer.load_state_dict(state["optimizer"])
    if critic is not None:
        critic.chunks[0].module.load_state_dict(state["critic"])
        critic.optimizer.load_state_dict(state["critic_optimizer"])
    mm.steps_done = int(extra.get("lr_steps_done", meta["step"]))
    rng = path / RNG_DIR / f"rank_{dist.get_rank()}.pt"
    if rng.is_file():
        load_rng(rng)
    if reference is not None:
        reference.load(state["reference"])
    return dict(extra, step=meta["step"])


def is_megatron_checkpoint(path: Path) -> bool:
    try:
        return json.loads((Path(path) / META).read_text()).get("backend") == BACKEND
    except (OSError, ValueError):
        return False


def save_hf(mm: MegatronModel, hf_assets_src: str, out_dir: Path) -> Path | None:
    """HF directory of the current weights (bridge export); every rank calls, rank 0 writes.

    The export is collective (every rank gathers each tensor); rank 0 writes shard by shard as
    the tensors come and the other ranks drop each one: no rank holds the whole model (every
    rank used to clone it, ~490 GB of host memory on a 30B node)."""
    weights = mm.named_hf_weights()
    if dist.get_rank() != 0:
        for _ in weights:
            pass
        return None
    try:
        config = omni.thinker_only_config(mm.bridge.hf_pretrained.config)  # the export's parts
        return write_hf_stream(weights, config, out_dir, hf_assets_src, overwrite=True)
    except BaseException:
        # the other ranks are inside the export's gathers: finish them, then fail
        for _ in weights:
            pass
        raise
