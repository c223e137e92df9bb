"""Training checkpoints with torch Distributed Checkpoint (DCP): save, commit atomically, load.

Every rank calls `save_checkpoint` / `load_checkpoint`. A checkpoint directory holds

    .metadata, __<rank>_0.distcp   DCP: model, optimizer, scheduler (each rank writes its shard)
    rng/rank_<r>.pt                RNG states of rank r (torch, cuda, python, numpy; rng.py)
    hf/                            config.json, generation_config.json, tokenizer (for conversion)
    meta.json                      step, world size, extra_state (data position, policy version,
                                   broker counters, config snapshot); written last by rank 0

The state dicts come from `torch.distributed.checkpoint.state_dict.get_state_dict`, which
unwraps DDP and keeps FSDP2 parameters as sharded DTensors, so one code path serves both, and
a checkpoint written by N ranks loads on M ranks (DCP reshards on load).

Commit protocol (rank 0, after every rank's shard and DCP's `.metadata` are on disk): write
meta.json into `step_<N>.tmp/`, rename it to `step_<N>/`, then replace the `latest` pointer,
then prune beyond keep_last. See resume.py for why this survives a crash at any point.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)

from relax_slurm.checkpoint.resume import (
    LATEST, META, CheckpointError, is_complete, list_checkpoints, step_dir_name,
)
from relax_slurm.checkpoint.rng import load_rng, save_rng

log = logging.getLogger("relax_slurm.checkpoint")
FORMAT = "relax-slurm-dcp"
FORMAT_VERSION = 1
# one collective of a save (planning, the final gather) may wait this long for a slow rank
SAVE_TIMEOUT = datetime.timedelta(minutes=30)
HF_ASSETS = "hf"
RNG_DIR = "rng"
MODEL_KEY = "model."  # the state dict is {"model": ..., "optimizer": ...}: its keys' prefix

_ckpt_group: dist.ProcessGroup | None = None  # gloo group of all ranks, for saves only
_pending: SaveHandle | None = None  # the async save in flight (at most one)


@dataclass
class SaveHandle:
    """A save in progress. `wait()` returns the committed directory (on rank 0; on other ranks
    once their part is written) and raises CheckpointError if the save failed."""

    step: int
    path: Path
    _future: Future = field(repr=False)
    _finalize: Callable[[], None] | None = field(default=None, repr=False)
    """Run by the first wait() on every rank before the result is read: a save whose ending is
    collective (the megatron backend's async save: every rank finalizes, then rank 0 commits)."""

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> Path:
        try:
            if self._finalize is not None:
                finalize, self._finalize = self._finalize, None
                finalize()
            self._future.result(timeout=timeout_s)
        except (Exception, CheckpointException) as e:  # the write or the commit failed
            raise CheckpointError(f"saving checkpoint step {self.step} to {self.path} failed: "
                                  f"{e}") from e
        return self.path


def save_checkpoint(
    ckpt_dir_root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    extra_state: dict[str, Any],
    keep_last: int,
    async_save: bool = False,
    hf_assets_src: str | Path | None = None,
    reference: nn.Module | None = None,
    critic: tuple[nn.Module, torch.optim.Optimizer] | None = None,
    trainable_only: bool = False,
) -> SaveHandle:
    """Save model, optimizer, scheduler, RNG and `extra_state` as `ckpt_dir_root/step_<step>/`.

    Every rank calls this. `extra_state` must be JSON-serialisable; rank 0's is written (other
    ranks may pass {}) and every rank gets it back from `load_checkpoint` (with "step" added).
    `hf_assets_src` is the HF model directory the run started from: its tokenizer and
    generation config are copied into the checkpoint so that `relax-convert` needs nothing
    else. With `async_save`, tensors are copied to CPU memory
    before this returns and written in a background thread while training goes on; a previous
    async save is waited for first (only one is in flight). `reference`: a frozen reference model
    that is not `model.path` as loaded (algo.ref_update_interval refreshes it), saved under
    "reference" (a plain replica on every rank: DCP writes one copy) for an exact resume.
    `critic`: algo=ppo's value model and its optimizer, saved under "critic" and
    "critic_optimizer" (sharded like the policy's). `trainable_only`: the model's parameters
    that require gradients, no frozen ones (model.lora: the adapter, not model.path's weights,
    which the run reads from model.path again).
    """
    global _pending
    if keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last}: keep at least 1 (trainer.keep_last)")
    if _pending is not None:
        prev, _pending = _pending, None
        prev.wait()
    root = Path(ckpt_dir_root)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp"
    # fail before writing anything if not serialisable
    meta_text = meta_json(step, _saved_extra(extra_state, step, reference, critic))
    rank, _ = _rank_world()
    group = checkpoint_group()
    if rank == 0:
        _start_tmp_dir(root, tmp, model, hf_assets_src)
    barrier(group)
    save_rng(tmp / RNG_DIR / f"rank_{rank}.pt")
    state = _state_to_save(model, optimizer, scheduler, reference, critic, trainable_only)
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, overwrite=True)
    kwargs = dict(storage_writer=writer, process_group=group, no_dist=group is None)

    def commit() -> None:
        commit_checkpoint(root, tmp, final, meta_text, keep_last)

    if not async_save:
        return _save_now(state, kwargs, step, tmp, final, rank, group, commit)
    _pending = _save_in_background(state, kwargs, step, final, rank, commit)
    return _pending


def _saved_extra(extra_state: dict[str, Any], step: int, reference: nn.Module | None,
                 critic: tuple | None) -> dict[str, Any]:
    """What meta.json records beside the caller's extra state: the step, and which side models
    the checkpoint holds."""
    extra = {**extra_state, "step": step}
    if reference is not None:
        extra["reference_saved"] = True
    if critic is not None:
        extra["critic_saved"] = True
    return extra


def _start_tmp_dir(root: Path, tmp: Path, model: nn.Module,
                   hf_assets_src: str | Path | None) -> None:
    """Rank 0: a fresh `step_N.tmp` (leftovers of an interrupted save removed) holding the HF
    assets; the checkpoint exists only once `commit_checkpoint` renames it."""
    root.mkdir(parents=True, exist_ok=True)
    remove_leftovers(root)
    tmp.mkdir()
    _write_hf_assets(model, hf_assets_src, tmp / HF_ASSETS)


def _state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any | None,
                   reference: nn.Module | None,
                   critic: tuple[nn.Module, torch.optim.Optimizer] | None,
                   trainable_only: bool = False) -> dict[str, Any]:
    """The DCP state dict: model and optimizer, and scheduler, reference and critic when given."""
    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=_model_options(trainable_only))
    state = {"model": model_sd, "optimizer": optim_sd}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if reference is not None:
        state["reference"] = reference.state_dict()
    if critic is not None:
        state["critic"], state["critic_optimizer"] = get_state_dict(*critic)
    return state


def _model_options(trainable_only: bool) -> StateDictOptions | None:
    # not strict on load: the frozen parameters are absent by design (the trainable ones are
    # still each read, or dcp.load fails naming the one missing)
    return (StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only
            else None)


def _save_now(state: dict[str, Any], kwargs: dict[str, Any], step: int, tmp: Path,
              final: Path, rank: int, group: dist.ProcessGroup | None,
              commit: Callable[[], None]) -> SaveHandle:
    """Write, then rank 0 commits; every rank returns after the commit."""
    try:
        with quiet_single_process():
            dcp.save(state, **kwargs)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        raise CheckpointError(f"writing checkpoint step {step} to {tmp} failed: "
                              f"{_first_line(e)}") from e
    if rank == 0:
        commit()
    barrier(group)  # every rank returns after the commit
    done: Future = Future()
    done.set_result(final)
    return SaveHandle(step, final, done)


def _save_in_background(state: dict[str, Any], kwargs: dict[str, Any], step: int, final: Path,
                        rank: int, commit: Callable[[], None]) -> SaveHandle:
    """Stage a CPU copy, write it from a background thread; rank 0 commits once it is written."""
    with quiet_single_process():
        upload = dcp.async_save(state, **kwargs)  # stages a CPU copy before returning
    if not isinstance(upload, Future):  # AsyncSaveResponse (when staging is itself async)
        upload = upload.upload_completion
    if rank == 0:
        # commit from a thread as soon as the write ends, even if nobody calls wait() yet
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-ckpt-commit")
        future = pool.submit(lambda: (upload.result(), commit()))
        pool.shutdown(wait=False)
    else:
        future = upload
    return SaveHandle(step, final, future)


def set_pending(handle: SaveHandle) -> None:
    """Make `handle` the async save in flight (after wait_pending(): at most one)."""
    global _pending
    assert _pending is None, "wait_pending() before starting another async save"
    _pending = handle


def wait_pending() -> None:
    """Wait for the async save in flight, if any (call before exiting); raises if it failed."""
    global _pending
    if _pending is not None:
        prev, _pending = _pending, None
        prev.wait()


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    reference: nn.Module | None = None,
    critic: tuple[nn.Module, torch.optim.Optimizer] | None = None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint into `model` (and `optimizer`, `scheduler`, this rank's RNG).

    Every rank calls this, with the model already wrapped (DDP/FSDP2) and the optimizer
    built. Returns the saved extra_state (with "step"). A weights-only checkpoint (from
    `relax-convert --to dcp`) loads the model and leaves optimizer and scheduler fresh.
    `reference`: loaded from the checkpoint's "reference" when it has one (saved with
    `reference=`), else left as it is (with a warning). `critic` (model, optimizer): loaded
    from the checkpoint's "critic" when it has one, else left fresh (with a warning).
    `trainable_only`: only the parameters that require gradients are read (saved so); the
    frozen ones stay as loaded from model.path.
    """
    path = Path(path)
    options = _model_options(trainable_only)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (needs .metadata and {META}); "
                              "use find_latest(run_dir) or point resume= at a step_<N> directory")
    meta = read_meta(path)
    weights_only = meta.get("weights_only", False)
    state: dict[str, Any] = {}
    if weights_only or optimizer is None:
        state["model"] = get_model_state_dict(model, options=options)
    else:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer, options=options)
    if not weights_only and scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    load_critic = _side_models(state, path, meta.get("extra_state", {}), reference, critic)
    group = dist.group.WORLD if dist.is_initialized() else None
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=FileSystemReader(path), process_group=group,
                     no_dist=group is None)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        raise CheckpointError(
            f"loading {path} failed: {_first_line(e)}. The checkpoint must come from the same "
            "model architecture (model.path) as this run; resume=none starts fresh"
        ) from e
    if "optimizer" in state:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)
    else:
        set_model_state_dict(model, state["model"], options=options)
    if load_critic:
        set_state_dict(critic[0], critic[1], model_state_dict=state["critic"],
                       optim_state_dict=state["critic_optimizer"])
    if "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    rank, _ = _rank_world()
    rng_file = path / RNG_DIR / f"rank_{rank}.pt"
    if rng_file.is_file():
        load_rng(rng_file)
    elif not weights_only:
        log.warning("%s has no RNG state for rank %d (saved with world size %s); RNG not restored",
                    path, rank, meta.get("world_size"))
    return dict(meta.get("extra_state", {}), step=meta["step"])


def _side_models(state: dict[str, Any], path: Path, saved: dict[str, Any],
                 reference: nn.Module | None,
                 critic: tuple[nn.Module, torch.optim.Optimizer] | None) -> bool:
    """Add the reference's and the critic's entries to `state` where the checkpoint has them
    (a warning where the run wants one it lacks); whether the critic is loaded."""
    if reference is not None:
        if saved.get("reference_saved"):
            state["reference"] = reference.state_dict()  # DCP loads in place
        else:
            log.warning("%s holds no reference model (saved without algo.ref_update_interval): "
                        "the reference stays model.path as loaded", path)
    if critic is not None and saved.get("critic_saved"):
        state["critic"], state["critic_optimizer"] = get_state_dict(*critic)
        return True
    if critic is not None:
        log.warning("%s holds no critic (saved by a run without one): the critic starts "
                    "fresh", path)
    return False


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's meta.json: format, step, world_size, weights_only, extra_state, ..."""
    meta = json.loads((Path(path) / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}/{META} is not a {FORMAT} checkpoint (format="
                              f"{meta.get('format')!r})")
    return meta


def meta_dict(step: int, extra_state: dict[str, Any], weights_only: bool = False) -> dict:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
        "world_size": _rank_world()[1], "weights_only": weights_only,
        "torch_version": torch.__version__,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "saved_unix": time.time(),  # orders checkpoints for find_latest and pruning
        "extra_state": extra_state,
    }


def meta_json(step: int, extra: dict[str, Any], weights_only: bool = False) -> str:
    try:
        return json.dumps(meta_dict(step, extra, weights_only), indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra_state of step {step} is not JSON-serialisable ({e}); pass "
                              "plain dicts, lists, str, int, float (no tensors, no NaN)") from e


# ---- commit ---------------------------------------------------------------------------------
def commit_checkpoint(root: Path, tmp: Path, final: Path, meta_text: str, keep_last: int) -> None:
    """Rank 0, after every shard and .metadata are on disk. Each step is a single rename."""
    write_file_atomic(tmp / META, meta_text)
    _fsync_dir(tmp)
    _replace_dir(tmp, final)
    _write_latest(root, final.name)
    _prune(root, keep_last, final)
    log.info("checkpoint committed: %s", final)


def _replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():  # the same step saved again (e.g. right after a resume): replace it
        doomed = final.with_name(final.name + ".del")
        shutil.rmtree(doomed, ignore_errors=True)
        final.rename(doomed)
        shutil.rmtree(doomed)
    tmp.rename(final)
    _fsync_dir(final.parent)


def _write_latest(root: Path, name: str) -> None:
    write_file_atomic(root / LATEST, name + "\n")


def _prune(root: Path, keep_last: int, final: Path) -> None:
    """Keep the keep_last most recently saved checkpoints (the one just committed among them).
    Save order, not step number: after resuming from an older checkpoint, the abandoned later
    steps are the oldest saves and go first."""
    found = [p for p in list_checkpoints(root) if p != final] + [final]
    for p in found[: max(0, len(found) - keep_last)]:
        doomed = p.with_name(p.name + ".del")
        p.rename(doomed)  # atomic: a half-deleted directory never looks complete
        shutil.rmtree(doomed)
        log.info("pruned checkpoint %s (keep_last=%d)", p, keep_last)


def remove_leftovers(root: Path) -> None:
    """Drop `.tmp` / `.del` directories a crashed save or prune left behind."""
    for child in root.iterdir():
        if child.is_dir() and child.suffix in (".tmp", ".del"):
            shutil.rmtree(child, ignore_errors=True)


def write_file_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- helpers --------------------------------------------------------------------------------
def _write_hf_assets(model: nn.Module, src: str | Path | None, out: Path) -> None:
    from relax_slurm.checkpoint.architecture import unwrap_model
    from relax_slurm.checkpoint.hf_files import copy_hf_assets

    config = getattr(unwrap_model(model), "config", None)
    if config is None and src is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    if config is not None:
        config.save_pretrained(out)
    if src is not None:
        copy_hf_assets(src, out, include_config=config is None)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group over all ranks for checkpoint collectives: async saves run them from a
    background thread, which must not interleave with the training collectives of the default
    group; gloo also works when the default group is NCCL."""
    global _ckpt_group
    if not dist.is_initialized():
        return None
    if _ckpt_group is None:
        _ckpt_group = dist.new_group(backend="gloo", timeout=SAVE_TIMEOUT)
    return _ckpt_group


def barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group=group)


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it assumes a single process even when told so with no_dist=True."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # DCP wraps the real error under a traceback; its last line names the key that failed
    return lines[-1] if lines else type(e).__name__
