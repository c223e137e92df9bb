"""torchrun --nproc-per-node 2 ckpt_dist_roundtrip.py --model-dir D --strategy ddp|fsdp2
    --root R --out F [--async-save] [--lora]

Trains the tiny model two steps on gloo under DDP or FSDP2, saving a checkpoint after each
(step 2 asynchronously with --async-save, and the weights keep changing while it is written).
Then builds a second, perturbed model + optimizer, loads the latest checkpoint into it and
compares (bit for bit) the full model and optimizer state, the scheduler, the RNG stream and
one more training step against the first model. Rank 0 writes findings as JSON to --out and
the step-2 weights to R/../ref_step2.safetensors.

--lora: PEFT's LoRA on the frozen model (model.lora, trainer/lora.py): the checkpoint holds the
adapter alone (the trainable parameters) and loads back bit for bit; what a weight sync and
save_hf send, the adapter (`adapter_of`) and the merged weights (`merged_parameters`), are whole
tensors equal bit for bit to what one process computes from the same weights (under FSDP2 each
rank holds shards: DTensors).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from relax_slurm.checkpoint import find_latest, load_checkpoint, save_checkpoint, wait_pending
from relax_slurm.config.model import LoraConfig, ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.runtime.exit import exit_now
from relax_slurm.trainer.lora import adapter_of, apply_lora, merged_parameters
from relax_slurm.trainer.model import build_optimizer, load_hf_model, unwrap, wrap_parallel

EXTRA = {"version": 2, "data": {"epoch": 0, "index": 8, "seed": 3, "num_rows": 300},
         "broker": {"accepted": 9, "consumed": 8, "dropped": 1}, "config": {"trainer": {"x": 1}}}


def model_config(args) -> ModelConfig:
    return ModelConfig(path=args.model_dir, lora=LoraConfig(rank=4 if args.lora else 0))


def build(args, perturb: bool):
    cfg = TrainerConfig(strategy=args.strategy, lr=1e-2, warmup_steps=3, nproc_per_node=2)
    raw = load_hf_model(model_config(args), torch.device("cpu"))
    if args.lora:
        raw = apply_lora(raw, model_config(args))
    model = wrap_parallel(raw, cfg, torch.device("cpu"))
    opt, sched = build_optimizer(model, cfg)
    if perturb:  # different weights and a non-empty, different optimizer state to overwrite
        train_step(model, opt, sched, step=99)
        with torch.no_grad():  # with --lora the adapter (the base stays model.path)
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(1.0)
    return model, opt, sched


def train_step(model, opt, sched, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randint(3, 18, (2, 12), generator=g)
    model(input_ids=x, labels=x).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def full_state(model, opt) -> dict[str, object]:
    """Flat {name: tensor or value} of full model + optimizer state on rank 0 ({} elsewhere)."""
    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat: dict[str, object] = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():
        for k, v in st.items():
            flat[f"optim.{fqn}.{k}"] = v.clone() if torch.is_tensor(v) else v
    flat["optim.param_groups"] = osd.get("param_groups")
    return flat if dist.get_rank() == 0 else {}


def compare(a: dict, b: dict) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        same = (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)) \
            if torch.is_tensor(x) else x == y
        if not same:
            bad.append(k)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--strategy", choices=("ddp", "fsdp2"), required=True)
    ap.add_argument("--root", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--async-save", action="store_true")
    ap.add_argument("--lora", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    res: dict[str, object] = {}
    try:
        model, opt, sched = build(args, perturb=False)
        train_step(model, opt, sched, step=1)
        save_checkpoint(args.root, 1, model, opt, sched, {"version": 1}, keep_last=2,
                        hf_assets_src=args.model_dir, trainable_only=args.lora).wait()
        train_step(model, opt, sched, step=2)
        ref2 = full_state(model, opt)
        t0 = time.monotonic()
        handle = save_checkpoint(args.root, 2, model, opt, sched, EXTRA, keep_last=2,
                                 async_save=args.async_save, hf_assets_src=args.model_dir,
                                 trainable_only=args.lora)
        res["save_return_s"] = time.monotonic() - t0
        rng_ref = torch.rand(4)
        sched_ref = sched.state_dict()
        train_step(model, opt, sched, step=3)  # with --async-save: while step 2 is written
        handle.wait(timeout_s=120)
        wait_pending()
        ref3 = full_state(model, opt)
        dist.barrier()
        latest = find_latest(args.root)

        model2, opt2, sched2 = build(args, perturb=True)
        extra = load_checkpoint(latest, model2, opt2, sched2, trainable_only=args.lora)
        res["rng_equal"] = torch.equal(torch.rand(4), rng_ref)
        got2 = full_state(model2, opt2)
        res["sched_equal"] = sched2.state_dict() == sched_ref
        train_step(model2, opt2, sched2, step=3)
        got3 = full_state(model2, opt2)
        save_checkpoint(args.root, 3, model2, opt2, sched2, {"version": 3}, keep_last=2,
                        trainable_only=args.lora)
        if args.lora:
            res.update(exports_against_one_process(args, model2, got3))
        res["rng_equal"] = all(_gather_bool(bool(res["rng_equal"])))
        if rank == 0:
            res.update(
                latest=latest.name, extra=extra, n_compared=len(ref2),
                mismatch_after_load=compare(ref2, got2), mismatch_next_step=compare(ref3, got3),
                n_optim_tensors=sum(k.startswith("optim.") for k in ref2),
                dirs=sorted(p.name for p in args.root.iterdir()),
                latest_after=find_latest(args.root).name,
            )
            weights = {k[len("model."):]: v for k, v in ref2.items() if k.startswith("model.")}
            weights.pop("lm_head.weight", None)  # tied to embed_tokens, as in an HF directory
            if not args.lora:
                save_file(weights, str(args.root.parent / "ref_step2.safetensors"))
            args.out.write_text(json.dumps(res, indent=2, default=str))
    finally:
        dist.destroy_process_group()
    # leave without freeing main()'s locals: a DDP Reducer freed last destroys its gloo group,
    # whose thread can be waiting for the GIL the freeing thread holds (a hang seen here);
    # the trainer role leaves the same way
    exit_now(0)


def exports_against_one_process(args, model, state: dict) -> dict:
    """The adapter and merged weights of `model` (every rank computes them: under FSDP2 each
    tensor is gathered) against one process's PEFT model holding `state` (its full state:
    rank 0's); mismatching names, on rank 0."""
    adapter = adapter_of(unwrap(model))
    merged = dict(merged_parameters(unwrap(model)))
    if dist.get_rank() != 0:
        return {}
    one = apply_lora(load_hf_model(model_config(args), torch.device("cpu")), model_config(args))
    one.load_state_dict({k[len("model."):]: v for k, v in state.items()
                         if k.startswith("model.")})
    want_adapter, want_merged = adapter_of(one), dict(merged_parameters(one))
    return {"adapter_names": len(adapter.tensors), "merged_names": len(merged),
            "adapter_mismatch": compare(adapter.tensors, want_adapter.tensors),
            "merged_mismatch": compare(merged, want_merged)}


def _gather_bool(flag: bool) -> list[bool]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, flag)
    return out


if __name__ == "__main__":
    main()
