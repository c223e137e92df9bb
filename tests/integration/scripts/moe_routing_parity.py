"""python moe_routing_parity.py --model-dir D --out F --url URL

The routed experts (R3) and log-probs that the engine at URL (the real SGLang, started with
--enable-return-routed-experts) reports for the tiny Qwen3-MoE D, against transformers' float32
forward of the same weights: first D's own, pushed over a gloo weight-update group as a trainer
pushes them (WeightSender), then other weights pushed the same way. The rollout worker's client
and decoder read the engine's answers (AsyncEngineClient, sample_routing). JSON to --out, per
weight set (`own`, `other`):
  version        /model_info's label after the push
  rows           sequences compared; positions: token x MoE-layer pairs compared
  max_lp_diff    the largest |engine - transformers| output-token log-prob
  mismatched     pairs whose top-k expert sets differ
  min_gap_mismatched  the smallest gap, in transformers' router logits, between the k-th and
                 the (k+1)-th expert at a mismatched pair (a near-tie; inf when none)
"""

import asyncio
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
import helpers_moe  # noqa: E402
import torch  # noqa: E402
from helpers_tiny import engine_script_args, free_port  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from relax_slurm.engines.async_client import AsyncEngineClient  # noqa: E402
from relax_slurm.engines.client import EngineClient  # noqa: E402
from relax_slurm.rollout.sampling import sample_routing  # noqa: E402
from relax_slurm.routing.shape import routing_shape  # noqa: E402
from relax_slurm.weightsync import WeightSender  # noqa: E402

PROMPTS = helpers_moe.PROMPTS[:4]
SAMPLES, MAX_NEW = 4, 8


def push(url: str, weights: list, version: int) -> str:
    sender = WeightSender([url], "127.0.0.1", free_port(), f"relax_moe_{version}", "gloo", 60.0,
                          bucket_mb=0.05, pause_mode="retract")
    sender.connect()
    try:
        sender.send(weights, version=version)
    finally:
        sender.destroy_on_engines()
        sender.close()
    with EngineClient(url, 60.0) as client:
        return client.weight_version()


async def generate(url: str) -> list:
    async with AsyncEngineClient(url, 120.0, routed_experts=True) as client:
        return await asyncio.gather(*(client.generate(
            [p] * SAMPLES, {"max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True})
            for p in PROMPTS))


def compare(model_dir: Path, url: str) -> dict:
    from transformers import AutoModelForCausalLM

    shape = routing_shape(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {"rows": 0, "positions": 0, "max_lp_diff": 0.0, "mismatched": 0,
           "min_gap_mismatched": math.inf}
    for prompt, results in zip(PROMPTS, asyncio.run(generate(url))):
        for r in results:
            tokens = prompt + r.output_ids
            n = len(tokens) - 1  # the positions a routing row covers: all but the last token
            routed = torch.from_numpy(sample_routing(r, len(prompt), shape, required=True)
                                      .astype("int64")).reshape(n, shape.layers, shape.topk)
            with torch.no_grad():
                fwd = model(torch.tensor([tokens]), output_router_logits=True)
            logp = torch.log_softmax(fwd.logits[0].float(), dim=-1)
            ours = logp[len(prompt) - 1:-1].gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0]
            out["max_lp_diff"] = max(out["max_lp_diff"], float(
                (ours - torch.tensor(r.logprobs)).abs().max()))
            for layer, logits in enumerate(fwd.router_logits):
                top = logits[:n].topk(shape.topk + 1, dim=-1)
                want = top.indices[:, :shape.topk].sort(dim=-1).values
                got = routed[:, layer].sort(dim=-1).values
                differ = (want != got).any(dim=-1)
                gaps = top.values[:, shape.topk - 1] - top.values[:, shape.topk]
                out["positions"] += n
                out["mismatched"] += int(differ.sum())
                if differ.any():
                    out["min_gap_mismatched"] = min(out["min_gap_mismatched"],
                                                    float(gaps[differ].min()))
            out["rows"] += 1
    return out


def main() -> None:
    args = engine_script_args()
    served = list(load_file(str(args.model_dir / "model.safetensors")).items())
    other_dir = args.out.parent / "other_model"  # the other weights, for transformers to read
    shutil.copytree(args.model_dir, other_dir, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    other = [(n, t + 0.3 * torch.randn(t.shape, generator=gen) * t.std().clamp(min=0.05))
             for n, t in served]
    save_file(dict(other), str(other_dir / "model.safetensors"), metadata={"format": "pt"})
    result = {}
    for name, weights, model_dir, version in (("own", served, args.model_dir, 1),
                                              ("other", other, other_dir, 2)):
        label = push(args.url, weights, version)
        result[name] = {"version": label, **compare(model_dir, args.url)}
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
