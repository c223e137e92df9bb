"""torchrun --nproc-per-node N megatron_critic_parity.py --model-dir D --tp T --out DIR [--torch]

algo=ppo's megatron critic (relax_slurm/trainer/megatron/critic.py) on gloo: builds the
megatron backend with its critic on the tiny HF model at TP=T (DP = N / T: each data-parallel
rank takes its share of the rows), gives the value head fixed
non-zero weights (a zero head would make every value 0 and hide the trunk), and on a fixed
batch of right-padded rows of different lengths (rank 0 writes DIR/result.json and tensors):
- `prepare` (the critic's values, GAE, whitening): DIR/values.pt (old_values, returns,
  advantages),
- the value loss's gradient through Megatron's schedule (`update` with the optimizer step
  replaced by a copy of each main_grad into its weight), read back under HF names through the
  bridge (the trunk) and directly (the head, whole on every TP rank): DIR/grads.safetensors,
  with the grad norm megatron's clipping sees and `update`'s metrics in result.json,
- with --torch (one rank): the same from the torch backend's critic (trainer/critic.py) on
  the same trunk weights and head: DIR/torch_values.pt, DIR/torch_grads.safetensors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from grad_capture import grads_into_weights
from script_result import each_layout, finish

from relax_slurm.algos.ppo import value_loss
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.batch import MicroBatch

MICRO = 4  # micro-batches of 4 and 2 rows: the schedule's last one is narrower


def batch(vocab: int) -> MicroBatch:
    """6 rows, right-padded to 12 tokens (lengths 12, 9, 7, 12, 5, 10), the second half of each
    row trained, each row's score (0 or 1) on its trained tokens; two rows hold the pad token
    among their real ones."""
    g = torch.Generator().manual_seed(0)
    lens = (12, 9, 7, 12, 5, 10)
    width = max(lens)
    ids = torch.randint(2, vocab, (len(lens), width), generator=g)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    weights = torch.zeros(len(lens), width - 1)
    for r, n in enumerate(lens):
        ids[r, n:] = 0
        mask[r, :n] = 1
        weights[r, n // 2:n - 1] = 1.0
    # the pad token (0) sampled inside two rows, as the tiny policy does: HF's embedding
    # (padding_idx) sends it no gradient, and the megatron model must not either (its row is
    # zero in the checkpoint: an RMS norm of it has a ~1/sqrt(eps) gradient)
    ids[0, 3] = ids[3, 8] = 0
    weights /= weights.sum()
    scores = (torch.arange(len(lens)) % 2).float()[:, None].expand(-1, width - 1)
    return MicroBatch(input_ids=ids, attention_mask=mask, targets=ids[:, 1:], weights=weights,
                      advantages=torch.where(weights != 0, scores, 0.0),
                      rollout_logp=torch.full((len(lens), width - 1), -1.0), seq_lens=lens)


def config(model_dir: str, trainer: TrainerConfig) -> TrainConfig:
    return TrainConfig(run_dir="unused", model=ModelConfig(path=model_dir),
                       algo=AlgoConfig(name="ppo", critic_lr=1e-2),
                       rollout=RolloutConfig(batch_size=3, n_samples_per_prompt=2),
                       trainer=trainer)


def head_weights(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, hidden, generator=g) / hidden ** 0.5, torch.tensor([0.1])


def megatron_side(args, result: dict) -> None:
    from relax_slurm.trainer.megatron.backend import MegatronBackend

    world = dist.get_world_size()
    cfg = config(args.model_dir, TrainerConfig(
        backend="megatron", tensor_parallel_size=args.tp, nproc_per_node=world, lr=1e-2,
        micro_batch_size=MICRO, grad_clip=1.0))
    backend = MegatronBackend(cfg, torch.device("cpu"))
    critic = backend.critic
    gpt = critic.mm.chunks[0].module
    w, b = head_weights(gpt.config.hidden_size)
    with torch.no_grad():
        gpt.output_layer.weight.copy_(w)
        gpt.output_layer.bias.copy_(b)
    from megatron.core import parallel_state as ps

    # each data-parallel rank its share of the rows (TP peers the same ones), as the trainer
    # scatters them; the weights keep summing to 1 over the whole batch
    whole = batch(critic.mm.vocab_size)
    dp, per = ps.get_data_parallel_world_size(), len(whole) // ps.get_data_parallel_world_size()
    block = whole.rows(ps.get_data_parallel_rank() * per, (ps.get_data_parallel_rank() + 1) * per)
    [(out, _)] = critic.prepare([(block, True)], None)

    saved = {id(p): p.detach().clone() for p in gpt.parameters()}
    with grads_into_weights(critic.mm, norm=True):  # the norm the metrics report
        result["metrics"] = critic.update([(out, True)], 1)
    head = {"value_head.weight": gpt.output_layer.weight.detach().clone(),
            "value_head.bias": gpt.output_layer.bias.detach().clone()}
    # the bridge exports the trunk under HF names (gathered over TP); the head, which has no HF
    # name, is out of its way for the export
    gpt.output_layer, real_head = torch.nn.Identity(), gpt.output_layer
    grads = {k: v.clone() for k, v in critic.mm.named_hf_weights()}
    gpt.output_layer = real_head
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(saved[id(p)])
    result["resume"] = resume_check(backend, block, args)
    values = {k: gather_rows(getattr(out, k), dp)
              for k in ("old_values", "returns", "advantages", "weights")}
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(values, args.out / "values.pt")
        save_file(grads | head, str(args.out / "grads.safetensors"))
    backend.close()


def gather_rows(t: torch.Tensor, dp: int) -> torch.Tensor:
    """Every data-parallel rank's rows, in rank order (each share is as wide as the batch:
    every share of batch() holds a 12-token row)."""
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(t) for _ in range(dp)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_data_parallel_group())
    return torch.cat(parts)


def resume_check(backend, block: MicroBatch, args) -> dict:
    """A whole backend step (critic values, GAE, policy step, critic step) so both optimizers
    hold Adam state, a checkpoint, one more step (A), the checkpoint loaded, the same step
    again (B): the critic's metrics and its values after the step equal bit for bit, and the
    load really restored the critic (its values are the saved ones, not A's)."""
    critic = backend.critic
    backend.train_step([(block, True)])
    at_save = critic.values(block)
    backend.save(args.out / "checkpoints", 1, {}, keep_last=1, async_save=False,
                 hf_assets_src=args.model_dir)
    a = backend.train_step([(block, True)])
    after_a = critic.values(block)
    extra = backend.load(args.out / "checkpoints" / "step_1")
    restored = critic.values(block)
    b = backend.train_step([(block, True)])
    after_b = critic.values(block)
    # a checkpoint of the policy alone (a run without a critic) leaves the critic as it is
    from relax_slurm.trainer.megatron import checkpoint

    checkpoint.save(args.out / "no_critic", 1, backend.mm, {}, keep_last=1, hf_assets_src=None)
    no_critic = backend.load(args.out / "no_critic" / "step_1")
    return {"critic_saved": bool(extra.get("critic_saved")),
            "no_critic_left_alone": ("critic_saved" not in no_critic
                                     and torch.equal(critic.values(block), after_b)),
            "restored_equal": torch.equal(restored, at_save),
            "step_moved_it": not torch.equal(after_a, at_save),
            "values_equal": torch.equal(after_a, after_b),
            "metrics": [a, b]}


def torch_side(args) -> None:
    """The torch critic on the same weights: values over the block, and the gradient of the
    same loss (the value loss x the batch's weights, summed: what `update` backpropagates on
    one rank)."""
    from relax_slurm.trainer.critic import Critic

    cfg = config(args.model_dir, TrainerConfig(nproc_per_node=1, micro_batch_size=MICRO,
                                               lr=1e-2, grad_clip=1.0))
    critic = Critic(cfg, torch.device("cpu"))
    model = critic.model.module if hasattr(critic.model, "module") else critic.model
    w, b = head_weights(model.value_head.weight.shape[1])
    with torch.no_grad():
        model.value_head.weight.copy_(w)
        model.value_head.bias.copy_(b)
    block = batch(model.config.vocab_size)
    [(out, _)] = critic.prepare([(block, True)], None)
    loss, _ = value_loss(model(**out.forward_kwargs())[:, :-1], out.old_values, out.returns,
                         cfg.algo.value_clip)
    (loss * out.weights).sum().backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()
             if p.grad is not None}
    torch.save({"old_values": out.old_values, "returns": out.returns,
                "advantages": out.advantages}, args.out / "torch_values.pt")
    save_file(grads, str(args.out / "torch_grads.safetensors"))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--torch", action="store_true", help="also the torch critic (one rank)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    result: dict = {}
    megatron_side(args, result)
    if args.torch:
        torch_side(args)
    finish(args.out, result)


if __name__ == "__main__":
    each_layout(main)
