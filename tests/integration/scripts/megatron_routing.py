"""torchrun --nproc-per-node N megatron_routing.py --model-dir D --batch B.pt [--tp T] [--ep E]
    --out DIR

Routing replay on megatron-core's routers (relax_slurm/trainer/megatron/routing.py): the tiny
MoE built through megatron-bridge in float32, one forward of a batch a bf16 engine generated
(B.pt: the collated MicroBatch's tensors), without and with replay, then one training step with
replay. Rank 0 writes DIR/result.json: per mode the token x layer pairs compared, how many the
router's own choice differs on, the response tokens' log-probs and |trainer - rollout| gaps,
and whether every router routed each covered token to exactly the rollout's experts; the
training step's metrics (train/loss, train/routing_mismatch_frac, ...), and its gradients under
HF names in DIR/grads.safetensors.

At TP > 1 (sequence parallelism) each TP rank's routers see a slice of the sequence: the
experts they used (the routing map each router returns) are all-gathered over the TP group and
put back in sequence order by megatron's definition of the split (contiguous equal chunks in
TP-rank order), independently of routing.py's mapping, before they are compared with the
rollout's at every covered token; the comparison counts are summed over the TP group.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from grad_capture import grads_into_weights
from script_result import each_layout, finish

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.routing.hooks import RoutingStats
from relax_slurm.trainer.batch import MicroBatch
from relax_slurm.trainer.megatron.model import MegatronModel, init_model_parallel
from relax_slurm.trainer.megatron.routing import megatron_routers, megatron_routing
from relax_slurm.trainer.megatron.step import train_step
from relax_slurm.trainer.step import gather_logprobs


def whole_sequence(local: torch.Tensor, rows: int, sequence_parallel: bool) -> torch.Tensor:
    """One router's per-token values [S_local x B, X] -> the whole padded sequence's [S x B, X]:
    each TP rank's slice all-gathered and concatenated along the sequence in TP-rank order."""
    from megatron.core import parallel_state as ps

    if not sequence_parallel:
        return local
    dtype = local.dtype
    mine = local.view(-1, rows, local.shape[-1]).to(torch.float32 if dtype.is_floating_point
                                                    else torch.int32).contiguous()
    parts = [torch.empty_like(mine) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, mine, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts).to(dtype).reshape(-1, local.shape[-1])


def tp_sum(x: float) -> float:
    from megatron.core import parallel_state as ps

    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    return float(t)


def forward(mm: MegatronModel, mb: MicroBatch, replay: bool) -> dict:
    stats, routed_as_asked, logits = RoutingStats(), [], {}
    B, W = mb.input_ids.shape
    valid = mb.routed_valid().transpose(0, 1).reshape(-1)  # megatron's token order: [S, B]

    def check(layer, router):
        K = router.topk
        want = mb.routed.reshape(B, W, -1, K)[:, :, layer].transpose(0, 1).reshape(-1, K)

        def hook(module, args, output):
            _, routing_map = output  # [tokens, experts] bool: the experts this router used
            used = whole_sequence(routing_map, B, mm.sequence_parallel)[:W * B]
            asked = torch.zeros_like(used).scatter_(1, want.long(), True)
            routed_as_asked.append(bool((used[valid] == asked[valid]).all()))
            if not replay:  # the router's logits at the covered tokens, for the test's margins
                scores = module.gating(args[0]).reshape(-1, used.shape[-1]).float()
                logits[layer] = whole_sequence(scores, B, mm.sequence_parallel)[:W * B][valid]
        return router.register_forward_hook(hook)

    handles = [check(layer, r) for layer, r in megatron_routers(mm.chunks)]
    with torch.no_grad(), megatron_routing(mm.chunks, mb.routed, mb.routed_valid(),
                                           replay=replay, stats=stats):
        out = mm.full_logits(mm.forward(mm.chunks[0], mb.input_ids))
    for h in handles:
        h.remove()
    logp = gather_logprobs(out[:, :W - 1].float(), mb.targets)
    gap = (logp - mb.rollout_logp).abs().masked_fill(mb.weights == 0, 0.0)
    return {"pairs": tp_sum(stats.pairs), "mismatched": tp_sum(stats.mismatched),
            "gap": gap.tolist(), "logp": logp.masked_fill(mb.weights == 0, 0.0).tolist(),
            "routed_as_asked": routed_as_asked,
            "router_logits": {str(k): v.tolist() for k, v in logits.items()}}


def replayed_step(mm: MegatronModel, mb: MicroBatch, out: Path) -> dict:
    """One training step with replay whose optimizer step is, for this call, a copy of each
    gradient into its weight: the gradients are then read through the bridge under HF names
    (rank 0 writes them); the step's metrics are returned."""
    with grads_into_weights(mm):
        metrics = train_step(mm, mb, AlgoConfig(routing_replay=True), micro_batch_size=32,
                             temperature=1.0)
    grads = {k: v.clone() for k, v in mm.named_hf_weights()}
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(grads, str(out / "grads.safetensors"))
    return metrics


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batch", required=True, type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    cfg = TrainerConfig(backend="megatron", tensor_parallel_size=args.tp,
                        expert_parallel_size=args.ep, nproc_per_node=dist.get_world_size())
    init_model_parallel(cfg)
    mm = MegatronModel(ModelConfig(path=args.model_dir), cfg)
    mm.chunks[0].eval()
    t = torch.load(args.batch)
    # every rank the whole batch: expert parallelism splits the experts, not the tokens
    mb = MicroBatch(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                    targets=t["input_ids"][:, 1:], weights=t["weights"],
                    advantages=t["advantages"], rollout_logp=t["rollout_logp"],
                    seq_lens=tuple(t["seq_lens"]), routed=t["routed"])
    result = {"own": forward(mm, mb, replay=False), "replayed": forward(mm, mb, replay=True),
              "sequence_parallel": mm.sequence_parallel}
    result["step"] = replayed_step(mm, mb, args.out)
    finish(args.out, result)


if __name__ == "__main__":
    each_layout(main)
