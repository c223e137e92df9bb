"""torchrun --nproc-per-node N megatron_routing.py --model-dir D --batch B.pt [--tp T] [--ep E]
    --out DIR

Routing replay on megatron-core's routers (relax_slurm/trainer/megatron/routing.py): the tiny
MoE built through megatron-bridge in float32, one forward of a batch a bf16 engine generated
(B.pt: the collated MicroBatch's tensors), without and with replay. Rank 0 writes
DIR/result.json: per mode the token x layer pairs compared, how many the router's own choice
differs on, the response tokens' |trainer - rollout| log-prob gaps, and whether every router
routed each covered token to exactly the rollout's experts.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from script_result import finish

from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.routing.hooks import RoutingStats
from relax_slurm.trainer.batch import MicroBatch
from relax_slurm.trainer.megatron.model import MegatronModel, init_model_parallel
from relax_slurm.trainer.megatron.routing import megatron_routers, megatron_routing
from relax_slurm.trainer.step import gather_logprobs


def forward(mm: MegatronModel, mb: MicroBatch, replay: bool) -> dict:
    stats, routed_as_asked = RoutingStats(), []
    B, W = mb.input_ids.shape
    valid = mb.routed_valid().transpose(0, 1).reshape(-1)  # megatron's token order: [S, B]

    def check(layer, router):
        K = router.topk
        want = mb.routed.reshape(B, W, -1, K)[:, :, layer].transpose(0, 1).reshape(-1, K)

        def hook(module, args, output):
            _, routing_map = output  # [tokens, experts] bool
            asked = torch.zeros_like(routing_map).scatter_(1, want.long(), True)
            routed_as_asked.append(bool((routing_map[valid] == asked[valid]).all()))
        return router.register_forward_hook(hook)

    handles = [check(layer, r) for layer, r in megatron_routers(mm.chunks)]
    with torch.no_grad(), megatron_routing(mm.chunks, mb.routed, mb.routed_valid(),
                                           replay=replay, stats=stats):
        logits = mm.full_logits(mm.forward(mm.chunks[0], mb.input_ids))
    for h in handles:
        h.remove()
    logp = gather_logprobs(logits[:, :-1].float(), mb.targets)
    gap = (logp - mb.rollout_logp).abs().masked_fill(mb.weights == 0, 0.0)
    return {"pairs": stats.pairs, "mismatched": stats.mismatched, "gap": gap.tolist(),
            "routed_as_asked": routed_as_asked}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batch", required=True, type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
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
    result = {"own": forward(mm, mb, replay=False), "replayed": forward(mm, mb, replay=True)}
    finish(args.out, result)


if __name__ == "__main__":
    main()
