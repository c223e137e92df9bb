"""torchrun --nproc-per-node N megatron_lora_parity.py --model-dir D --tp T [--ep E] [--dist-opt]
    --inputs F --out DIR

(data parallelism is the rest of the N ranks: each DP rank trains its block of the batch's rows;
--ep: expert parallelism on an MoE model; --dist-opt: trainer.use_distributed_optimizer)

model.lora under trainer=megatron on gloo (relax_slurm/trainer/megatron/lora.py): builds the
HF model through megatron-bridge at TP=T with CanonicalLoRA on `--targets` (rank, alpha), loads
the adapter in F (PEFT's saved names, full tensors; F also holds the batch, `batch.*`), then
(rank 0 writes DIR/result.json and DIR/{exported,grads,merged}.safetensors)
- exports the adapter back under PEFT's names (the round trip the test compares bit for bit),
  and the weights with the adapter merged (the bridge's HF export, as a merged sync sends),
- records which parameters require gradients and get Megatron DDP gradient buffers,
- runs one training step of the trainer's loss on the batch (megatron's train_step) with the
  optimizer's step replaced by a copy of each adapter's main_grad into it: the adapter's
  gradients, exported under PEFT's names, and the step's loss,
- checks that the step left every base weight as it was, and that the adapters disabled give
  the logits of the model without adapters (the reference policy),
- then, from the adapter loaded, runs the real optimizer step (Megatron's Adam, sharded over
  the DP ranks with --dist-opt) on those gradients and exports the adapter it leaves
  (DIR/stepped.safetensors; the test compares the two optimizers' results),
- with --resume, saves the trainer's adapter-only dist-checkpoint there (the adapters and the
  optimizer's state, sharded over the DP ranks with --dist-opt), trains one more step, loads
  the checkpoint and trains that step again: `resume_exact` when the two steps' loss, grad
  norm and adapter are bitwise equal.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from script_result import each_layout, finish

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.model import LoraConfig, ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.batch import MicroBatch

BATCH_KEYS = ("input_ids", "attention_mask", "targets", "weights", "advantages", "rollout_logp")


def batch_from(tensors: dict[str, torch.Tensor]) -> MicroBatch:
    """The MicroBatch stored under `batch.<field>` (all rows full length)."""
    fields = {k: tensors[f"batch.{k}"] for k in BATCH_KEYS}
    rows, width = fields["input_ids"].shape
    return MicroBatch(**fields, seq_lens=(width,) * rows)


def gather_reduce_scattered_grads(mm) -> None:
    """With the distributed optimizer Megatron DDP reduce-scatters the gradient buffers: each
    DP rank's shard of every bucket (megatron's shard_buffer: equal contiguous parts in rank
    order) holds the reduced gradient, the rest this rank's own. Each shard is all-gathered
    over the bucket group's DP group, so every main_grad holds the reduced gradient, as the
    all-reduce of the plain optimizer leaves it."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in mm.chunks:
        for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
            pg = group.intra_distributed_optimizer_instance_group
            size, rank = dist.get_world_size(pg), dist.get_rank(pg)
            for bucket in group.buckets:
                shards = shard_buffer(bucket.grad_data, size)
                dist.all_gather(shards, shards[rank].clone(), group=pg)


@contextmanager
def adapter_grads_into_weights(mm, distributed_optimizer: bool):
    """Within the block the optimizer's step copies each trainable parameter's main_grad (what
    Megatron DDP accumulated) into it and updates nothing, so the bridge's adapter export
    returns the gradients (as grad_capture.grads_into_weights, for the adapters only: frozen
    parameters have no main_grad)."""
    real_step = mm.optimizer.step

    def step():
        if distributed_optimizer:
            gather_reduce_scattered_grads(mm)
        with torch.no_grad():
            for c in mm.chunks:
                for p in c.module.parameters():
                    if p.requires_grad:
                        p.copy_(p.main_grad)
        return True, 0.0, 0

    mm.optimizer.step = step
    try:
        yield
    finally:
        mm.optimizer.step = real_step


def resume_check(mm, model_cfg, rows, args, saved_adapter: dict) -> dict:
    """Save the trainer's checkpoint (backend.save's adapter-only form), step, load, step
    again: the second step repeats the first bitwise when the adapters and the optimizer's
    state came back exactly."""
    from relax_slurm.trainer.megatron import checkpoint, lora
    from relax_slurm.trainer.megatron.step import train_step

    record = {lora.CHECKPOINT_KEY: lora.checkpoint_record(model_cfg)}
    saved = checkpoint.save(args.out / "checkpoints", 1, mm, record, keep_last=1,
                            hf_assets_src=None, adapter_only=True).path

    def step():
        m = train_step(mm, rows, AlgoConfig(), micro_batch_size=args.micro_batch_size,
                       temperature=1.0)
        return m, lora.adapter_tensors(mm.bridge, mm.chunks)

    (m1, a1), steps_saved = step(), mm.steps_done
    checkpoint.load(saved, mm, adapter_only=True)
    m2, a2 = step()
    same = [m1[k] == m2[k] for k in ("train/loss", "train/grad_norm")]
    return {"resume_exact": all(same) and all(torch.equal(a1[k], a2[k]) for k in a1),
            "resume_moved": all(not torch.equal(a1[k], v) for k, v in saved_adapter.items()),
            "resume_steps_done": [steps_saved, mm.steps_done],
            "resume_checkpoint_keys_adapter_only": checkpoint_keys_adapter_only(saved)}


def checkpoint_keys_adapter_only(path: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return bool(keys) and all(".adapter." in k for k in keys)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dist-opt", action="store_true", help="trainer.use_distributed_optimizer")
    ap.add_argument("--resume", action="store_true", help="check the checkpoint's exact resume")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--micro-batch-size", type=int, default=3)
    ap.add_argument("--inputs", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)

    from megatron.core import parallel_state as ps

    from relax_slurm.trainer.megatron import lora
    from relax_slurm.trainer.megatron.model import MegatronModel, init_model_parallel
    from relax_slurm.trainer.megatron.step import train_step

    cfg = TrainerConfig(backend="megatron", tensor_parallel_size=args.tp, lr=1e-2,
                        pipeline_parallel_size=args.pp,
                        expert_parallel_size=args.ep, use_distributed_optimizer=args.dist_opt,
                        micro_batch_size=args.micro_batch_size,
                        nproc_per_node=dist.get_world_size())
    model_cfg = ModelConfig(path=args.model_dir, lora=LoraConfig(
        rank=args.rank, alpha=args.alpha, target_modules=args.targets.split(",")))
    init_model_parallel(cfg)
    pefts: list = []
    mm = MegatronModel(model_cfg, cfg,
                       adapt=lambda bare: pefts.append(lora.apply_lora(bare, model_cfg)))
    inputs = load_file(str(args.inputs))
    adapter_in = {k: v for k, v in inputs.items() if not k.startswith("batch.")}
    result: dict = {}

    named = [(n, p) for c in mm.chunks for n, p in c.module.named_parameters()]
    # over the pipeline stages: each holds its layers' (the names are the stage's own)
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, sorted(n for n, p in named if p.requires_grad),
                           group=ps.get_pipeline_model_parallel_group())
    result["trainable"] = sorted(n for names in stages for n in names)
    result["frozen_not_adapter"] = all(not p.requires_grad for n, p in named
                                       if not lora.is_adapter_param(n))
    result["frozen_have_no_grad_buffer"] = all(not hasattr(p, "main_grad") for _, p in named
                                               if not p.requires_grad)
    result["optimizer_params"] = sum(p.numel() for g in mm.optimizer.param_groups
                                     for p in g["params"])
    held = torch.tensor(result["optimizer_params"])  # over the DP ranks: each its shard
    dist.all_reduce(held, group=ps.get_data_parallel_group())
    result["optimizer_params_dp_sum"] = int(held)
    local = torch.tensor([sum(p.numel() for _, p in named if p.requires_grad),
                          result["optimizer_params"]])
    dist.all_reduce(local, group=ps.get_pipeline_model_parallel_group())
    result["local_adapter_params"], result["optimizer_params"] = map(int, local)

    lora.load_adapter(mm.bridge, mm.chunks, adapter_in)
    exported = lora.adapter_tensors(mm.bridge, mm.chunks)
    # what a merged sync and save_hf send: the bridge's export merges each adapter into its
    # base weight (W + alpha / r * B @ A), under HF names
    merged = {k: v.clone() for k, v in mm.named_hf_weights()}

    base_before = {n: p.detach().clone() for n, p in named if not p.requires_grad}
    adapters_before = {n: p.detach().clone() for n, p in named if p.requires_grad}
    batch = batch_from(inputs)
    # data parallelism: each DP rank trains its block of rows (the weights sum to 1 over the
    # whole batch); Megatron DDP all-reduces the adapters' gradients
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    block = len(batch) // dp
    mine = batch.rows(dp_rank * block, (dp_rank + 1) * block)
    with adapter_grads_into_weights(mm, args.dist_opt):
        metrics = train_step(mm, mine, AlgoConfig(), micro_batch_size=args.micro_batch_size,
                             temperature=1.0)
    result["loss"] = metrics["train/loss"]
    grads = lora.adapter_tensors(mm.bridge, mm.chunks)
    result["base_unchanged"] = all(torch.equal(p, base_before[n]) for n, p in named
                                   if not p.requires_grad)
    result["base_grads_none"] = all(p.grad is None for _, p in named if not p.requires_grad)
    with torch.no_grad():  # the adapters back, for the reference check
        for n, p in named:
            if p.requires_grad:
                p.copy_(adapters_before[n])

    # the reference policy: the adapters disabled are model.path (the HF model's log-probs),
    # by the forward-only schedule (every layout; filled on the last pipeline stage)
    from relax_slurm.trainer.megatron.step import forward_logprobs

    with pefts[0].disable_adapter(mm.chunks):
        off = forward_logprobs(mm, mm.chunks, batch, None, 1, args.micro_batch_size, 1.0)
    on = forward_logprobs(mm, mm.chunks, batch, None, 1, args.micro_batch_size, 1.0)
    from transformers import AutoModelForCausalLM

    from relax_slurm.trainer.step import token_logprobs

    hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base = token_logprobs(hf, batch, 1.0)
    last = ps.is_pipeline_last_stage()
    diffs = torch.tensor([(off - base).abs().max().item() if last else 0.0,
                          (on - base).abs().max().item() if last else 0.0])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    result["disabled_logprobs_max_diff"], result["enabled_differs_by"] = map(float, diffs)
    # the real step (Adam) on these gradients, from the adapter loaded: the plain and the
    # distributed optimizer must leave the same adapter
    ok, grad_norm, _ = mm.optimizer.step()
    result["step_ok"], result["step_grad_norm"] = bool(ok), float(grad_norm)
    stepped = lora.adapter_tensors(mm.bridge, mm.chunks)
    if args.resume:
        result.update(resume_check(mm, model_cfg, mine, args, stepped))
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        save_file(exported, str(args.out / "exported.safetensors"))
        save_file(grads, str(args.out / "grads.safetensors"))
        save_file(merged, str(args.out / "merged.safetensors"))
        save_file(stepped, str(args.out / "stepped.safetensors"))
    result["tp_size"] = ps.get_tensor_model_parallel_world_size()
    result["pp_size"] = ps.get_pipeline_model_parallel_world_size()
    result["dp_size"] = dp
    result["ep_size"] = ps.get_expert_model_parallel_world_size()
    # (a ChainedOptimizer of the dense and the expert parameters' on an MoE model)
    result["optimizers"] = sorted({type(o).__name__ for o in getattr(
        mm.optimizer, "chained_optimizers", [mm.optimizer])})
    finish(args.out, result)


if __name__ == "__main__":
    each_layout(main)
