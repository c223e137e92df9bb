"""torchrun --nproc-per-node N megatron_parity.py --model-dir D --tp T --pp P [--ep E] [--dist-opt]
    --out DIR

The megatron backend on gloo: builds the tiny HF model through megatron-bridge at the given
TP/PP sizes, then (rank 0 writes DIR/result.json)
- exports it back through the bridge and compares with the HF safetensors bit for bit,
- compares its logits with the transformers model's on fixed tokens,
- runs one forward/backward on a fixed synthetic batch (the trainer's GRPO loss) and writes the
  gradients, under HF names, to DIR/grads.safetensors,
- trains two steps on that batch and writes the exported weights to DIR/trained.safetensors,
for the test to compare across TP/PP sizes,
- saves a Megatron dist-checkpoint (DIR/checkpoints/step_2), trains one more step, loads the
  checkpoint back and trains that step again (weights restored and the step repeated bitwise);
  with --async-save that checkpoint is written asynchronously during the next step, and a
  synchronous save of the same state goes to DIR/checkpoints_sync/step_2 for comparison,
- from that checkpoint, trains one batch as two optimizer steps (trainer.num_steps_per_rollout=2)
  and, without pipeline stages, the same two steps by hand (mini_batch_check),
- builds the sharded KL reference and checks it against transformers, after a refresh against
  the policy, and through a checkpoint (reference_check).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from grad_capture import grads_into_weights
from script_result import each_layout, finish

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.batch import MicroBatch
from relax_slurm.trainer.megatron import checkpoint
from relax_slurm.trainer.megatron.model import MegatronModel, init_model_parallel
from relax_slurm.trainer.megatron.step import train_step, with_old_logprobs
from relax_slurm.trainer.megatron import vocab_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import process_cpu_s  # noqa: E402


def synthetic_batch(vocab: int, rows: int, width: int) -> MicroBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (rows, width), generator=g)
    weights = torch.zeros(rows, width - 1)
    weights[:, width // 2:] = 1.0 / (rows * (width - 1 - width // 2))
    return MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), targets=ids[:, 1:],
                      weights=weights, advantages=torch.randn(rows, width - 1, generator=g),
                      rollout_logp=torch.full((rows, width - 1), -1.0),
                      seq_lens=(width,) * rows)


def shard_logprobs(mm: MegatronModel, mb: MicroBatch) -> torch.Tensor:
    """The step's log-probs of one micro-batch written out: this TP rank's vocabulary slice
    through vocab_parallel.py, the kernels the step runs."""
    from megatron.core import parallel_state as ps

    out = mm.forward(mm.chunks[0], mb.input_ids, attention_mask=mb.attention_mask)[:, :-1]
    start = ps.get_tensor_model_parallel_rank() * out.shape[-1]
    shard = vocab_parallel.scaled_shard(out, start, mm.vocab_size, 1.0, mm.banned_ids)
    group = (ps.get_tensor_model_parallel_group()
             if ps.get_tensor_model_parallel_world_size() > 1 else None)
    return vocab_parallel.logprobs_and_entropy(shard, mb.targets, start, group, None)[0]


def mini_batch_check(mm: MegatronModel, mine: MicroBatch, ckpt: Path, *, pp: int,
                     micro_batch_size: int) -> dict:
    """trainer.num_steps_per_rollout=2 from the checkpoint's state, and (without pipeline
    stages, where one forward gives the logits) the same two steps by hand: the policy's
    log-probs before them as "old", then one step per half of the rows with its weights
    doubled (x2 is exact). Same kernels in the same order: the weights must be equal bitwise.
    `old_logp_sum`: the old log-probs the step computes, summed where the loss is (the last
    pipeline stage, one TP rank, every data-parallel rank), for the test to compare layouts."""
    from megatron.core import parallel_state as ps

    algo = AlgoConfig(old_logprobs="recompute")
    checkpoint.load(ckpt, mm)
    before = {k: v.clone() for k, v in mm.named_hf_weights()}
    old = with_old_logprobs(mm, mine, algo, 2, micro_batch_size, 1.0).old_logp
    counted = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    total = torch.tensor(float(old.double().sum()) if counted else 0.0, dtype=torch.float64)
    dist.all_reduce(total)
    start = mm.steps_done
    metrics = train_step(mm, mine, algo, micro_batch_size=micro_batch_size, temperature=1.0,
                         num_steps=2)
    two_steps = {k: v.clone() for k, v in mm.named_hf_weights()}
    out = {"metrics": metrics, "lr_steps": mm.steps_done - start,
           "old_logp_sum": float(total),
           "moved": any(not torch.equal(two_steps[k], before[k]) for k in before)}
    if pp > 1:
        return out
    checkpoint.load(ckpt, mm)
    with torch.no_grad():
        by_hand_old = torch.cat([shard_logprobs(mm, mb) for mb in (
            mine.rows(lo, lo + micro_batch_size) for lo in range(0, len(mine), micro_batch_size))])
    out["old_equal_by_hand"] = torch.equal(old, by_hand_old)
    half = len(mine) // 2
    for lo in (0, half):
        mb = dataclasses.replace(mine.rows(lo, lo + half), old_logp=by_hand_old[lo:lo + half],
                                 weights=mine.weights[lo:lo + half] * 2)
        mm.steps_done = start  # one lr per batch
        train_step(mm, mb, algo, micro_batch_size=micro_batch_size, temperature=1.0)
    by_hand = {k: v.clone() for k, v in mm.named_hf_weights()}
    out["equal_by_hand"] = all(torch.equal(two_steps[k], by_hand[k]) for k in by_hand)
    return out


def reference_check(mm: MegatronModel, model_dir: str, mine: MicroBatch, out: Path, *,
                    micro_batch_size: int) -> dict:
    """The KL reference (megatron/reference.py), built while the policy has trained: model.path
    sharded as the policy. Its log-probs against the transformers model's on this rank's rows
    (max difference over the ranks that compute the loss); after a refresh, bitwise the
    policy's own (the old log-probs' pass); saved in a checkpoint and loaded into a fresh
    reference, bitwise the refreshed one's."""
    from megatron.core import parallel_state as ps

    from relax_slurm.trainer.megatron.reference import MegatronReference
    from relax_slurm.trainer.model import load_reference_model
    from relax_slurm.trainer.step import token_logprobs

    counted = ps.is_pipeline_last_stage()

    def agree(flag: bool) -> bool:
        t = torch.tensor(0.0 if flag else 1.0)
        dist.all_reduce(t)
        return float(t) == 0.0

    def logprobs(ref: MegatronReference) -> torch.Tensor:
        return ref.with_logprobs(mm, mine, 1, micro_batch_size, 1.0).ref_logp

    model_cfg = ModelConfig(path=model_dir)
    ref = MegatronReference(mm, model_cfg)
    ours = logprobs(ref)
    hf = load_reference_model(model_cfg, torch.device("cpu"))
    theirs = torch.zeros_like(ours)
    for lo in range(0, len(mine), micro_batch_size):
        mb = mine.rows(lo, lo + micro_batch_size)
        theirs[lo:lo + len(mb), :mb.targets.shape[1]] = token_logprobs(hf, mb, 1.0)
    mask = mine.attention_mask[:, 1:].bool()
    diff = torch.tensor((ours - theirs)[mask].abs().max().item() if counted else 0.0)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    policy = with_old_logprobs(mm, mine, AlgoConfig(), 1, micro_batch_size, 1.0).old_logp
    result = {"vs_transformers_max_diff": float(diff),
              "differs_from_policy": not agree(not counted or torch.equal(ours, policy))}
    ref.refresh(mm)
    refreshed = logprobs(ref)
    result["refreshed_equals_policy"] = agree(not counted or torch.equal(refreshed, policy))
    checkpoint.save(out / "ref_checkpoints", mm.steps_done, mm, {}, keep_last=1,
                    hf_assets_src=model_dir, reference=ref)
    fresh = MegatronReference(mm, model_cfg)
    checkpoint.load(out / "ref_checkpoints" / f"step_{mm.steps_done}", mm, reference=fresh)
    loaded = logprobs(fresh)  # every rank: a pipeline's forward
    result["loaded_equals_refreshed"] = agree(not counted or torch.equal(loaded, refreshed))
    return result


def results_manager_cpu_s() -> float:
    """CPU seconds of the process serving the saves' write-results queue (megatron-core
    spawns it, checkpoint.py forks it): a spawned one imported this script's torch,
    transformers and megatron again (~2.5 CPU-s), a forked one imports nothing."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return process_cpu_s(filesystem_async._results_queue._manager._process.pid)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dist-opt", action="store_true", help="trainer.use_distributed_optimizer")
    ap.add_argument("--async-save", action="store_true",
                    help="save step 2 synchronously (DIR/checkpoints_sync) and asynchronously "
                         "(DIR/checkpoints); the next step trains while the writer runs")
    ap.add_argument("--recompute", default="none", help="trainer.recompute")
    ap.add_argument("--logprob-chunk-size", type=int, default=0,
                    help="trainer.logprob_chunk_size")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    cfg = TrainerConfig(backend="megatron", tensor_parallel_size=args.tp,
                        pipeline_parallel_size=args.pp, expert_parallel_size=args.ep, lr=1e-2,
                        use_distributed_optimizer=args.dist_opt, recompute=args.recompute,
                        logprob_chunk_size=args.logprob_chunk_size,
                        grad_clip=1.0, micro_batch_size=4, nproc_per_node=dist.get_world_size())
    init_model_parallel(cfg)
    mm = MegatronModel(ModelConfig(path=args.model_dir), cfg)
    rank = dist.get_rank()
    result: dict = {}

    hf_sd = load_file(str(Path(args.model_dir) / "model.safetensors"))
    exported = dict(mm.named_hf_weights())
    result["exported_names"] = sorted(exported)
    result["hf_names"] = sorted(hf_sd)
    result["export_bitwise"] = all(torch.equal(exported[k], hf_sd[k]) for k in hf_sd
                                   if k in exported)

    from megatron.core import parallel_state as ps
    ids = torch.randint(0, mm.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    if args.pp == 1:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            ours = mm.full_logits(mm.forward(mm.chunks[0], ids))
            result["logits_max_diff"] = (ours - hf(ids).logits).abs().max().item()

    batch = synthetic_batch(mm.vocab_size, rows=8, width=10)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    block = len(batch) // dp
    mine = batch.rows(dp_rank * block, (dp_rank + 1) * block)
    # gradients of one forward/backward, read through the bridge under HF names: the
    # optimizer step is replaced for this one call by a copy of each main_grad into its weight
    saved = {id(p): p.detach().clone() for c in mm.chunks for p in c.module.parameters()}
    with grads_into_weights(mm):
        train_step(mm, mine, AlgoConfig(), micro_batch_size=cfg.micro_batch_size,
                   temperature=1.0)
    grads = {k: v.clone() for k, v in mm.named_hf_weights()}  # exports may alias the weights
    mm.steps_done = 0
    with torch.no_grad():
        for c in mm.chunks:
            for p in c.module.parameters():
                p.copy_(saved[id(p)])
    steps = [train_step(mm, mine, AlgoConfig(), micro_batch_size=cfg.micro_batch_size,
                        temperature=1.0) for _ in range(2)]
    result["steps"] = steps
    trained = {k: v.clone() for k, v in mm.named_hf_weights()}

    # Megatron dist-checkpoint: save, move on one step, load, and the same next step again
    root = args.out / "checkpoints"
    if args.async_save:
        checkpoint.save(args.out / "checkpoints_sync", 2, mm, {"marker": 7}, keep_last=1,
                        hf_assets_src=args.model_dir)
    handle = checkpoint.save(root, 2, mm, {"marker": 7}, keep_last=1,
                             hf_assets_src=args.model_dir, async_save=args.async_save)
    after = train_step(mm, mine, AlgoConfig(), micro_batch_size=cfg.micro_batch_size,
                       temperature=1.0)
    result["committed_while_training"] = (root / "step_2" / "meta.json").exists()
    handle.wait(timeout_s=300)
    result["results_manager_cpu_s"] = results_manager_cpu_s()
    after_w = {k: v.clone() for k, v in mm.named_hf_weights()}
    extra = checkpoint.load(root / "step_2", mm)
    restored = {k: v.clone() for k, v in mm.named_hf_weights()}
    again = train_step(mm, mine, AlgoConfig(), micro_batch_size=cfg.micro_batch_size,
                       temperature=1.0)
    again_w = dict(mm.named_hf_weights())
    result["resume"] = {
        "extra": extra,
        "weights_restored": all(torch.equal(restored[k], trained[k]) for k in trained),
        "next_step_equal": all(torch.equal(again_w[k], after_w[k]) for k in after_w),
        "next_loss": [after["train/loss"], again["train/loss"]],
    }
    result["mini_batches"] = mini_batch_check(mm, mine, root / "step_2", pp=args.pp,
                                              micro_batch_size=cfg.micro_batch_size)
    result["reference"] = reference_check(mm, args.model_dir, mine, args.out,
                                          micro_batch_size=cfg.micro_batch_size)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        save_file(trained, str(args.out / "trained.safetensors"))
        save_file(grads, str(args.out / "grads.safetensors"))
    finish(args.out, result)


if __name__ == "__main__":
    each_layout(main)
