"""The critic of algo=ppo under trainer=megatron: a megatron-core value model.

    critic = MegatronCritic(cfg, bridge)          # the policy's GPT provider, a scalar head
    blocks = critic.prepare(blocks, reward_kl)    # values, GAE, whitened advantages, returns
    metrics = critic.update(blocks, num_steps)    # clipped value loss, Megatron's schedule

The model is the policy's: the same megatron-bridge provider (model.path's weights, the same
TP/EP sizes, megatron DDP, Megatron's optimizer, distributed when the policy's is), built
once more with its output layer replaced by a value head, hidden -> 1 with a bias,
initialised to 0 as the torch critic's (trainer/critic.py): the first values are 0 and no RNG
is drawn. As in verl's and slime's megatron critics the head is not split over TP (one output
column cannot be): every TP rank holds it whole and computes the same values from the same
full hidden states, so the gradient it sends back into the decoder is already whole (the LM
head's ColumnParallelLinear has to all-reduce it; this head must not). Its optimizer steps at
the constant `algo.critic_lr` (null: 5 x trainer.lr) with the trainer's betas, weight decay
and gradient clip. The order of a step and the GAE are shared with the torch critic
(trainer/critic_step.py).

Layouts: TP, DP, EP (and the distributed optimizer). Pipeline and context parallelism are
refused at config validation (cross_checks.check_critic_backend): the values would exist on
the last pipeline stage only, and under CP on two sequence chunks per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relax_slurm.algos.common import kl_penalty
from relax_slurm.algos.ppo import value_loss
from relax_slurm.config import TrainConfig
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.batch import MicroBatch
from relax_slurm.trainer.critic_step import (
    Blocks, RewardKL, add_sums, critic_lr, reduce_sums, with_gae, zero_sums,
)
from relax_slurm.trainer.megatron import vl
from relax_slurm.trainer.megatron.model import MegatronModel
from relax_slurm.trainer.megatron.step import micro_batches, with_old_logprobs
from relax_slurm.trainer.step import mini_batches

LossOf = Callable[[int, MicroBatch], Callable[[Tensor], tuple[Tensor, dict]]]


class ValueHead(nn.Linear):
    """GPTModel's output layer for a critic: hidden [S, B, H] -> values [S, B, 1], called as
    megatron-core calls its output layer (`weight=`, `runtime_gather_output=` ignored: the
    head is its own, never the tied embedding). Under sequence parallelism (MoE at TP > 1,
    GPU only, unverified) each TP rank holds S/TP positions: the values are gathered with a
    split (not a reduce-scatter) as backward, since every rank's loss is the whole loss, and
    the head's own gradients, partial per rank, are all-reduced over TP by megatron's
    finalize_model_grads (the `sequence_parallel` tag, as its layer norms')."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 sequence_parallel: bool) -> None:
        super().__init__(hidden_size, 1, dtype=dtype, device=device)
        with torch.no_grad():  # V = 0 until trained; no RNG drawn (runs stay reproducible)
            self.weight.zero_()
            self.bias.zero_()
        self.sequence_parallel = sequence_parallel
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: Tensor, weight: Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[Tensor, None]:
        out = super().forward(hidden_states)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out, None


def attach_value_heads(chunks: list) -> None:
    """Each bare chunk's LM head replaced by a fresh ValueHead, and untied from the input
    embedding (a tied model would otherwise hand the head the embedding's weight and
    checkpoint it as the embedding's)."""
    for chunk in chunks:
        gpt = getattr(chunk, "module", chunk)  # Float16Module around it in bf16 / fp16
        config = gpt.config
        # on the trunk's device (GPU: the provider has moved the chunk there already)
        device = next(gpt.parameters()).device
        gpt.output_layer = ValueHead(config.hidden_size, config.params_dtype, device,
                                     bool(config.sequence_parallel))
        gpt.share_embeddings_and_output_weights = False


class MegatronCritic:
    def __init__(self, cfg: TrainConfig, bridge) -> None:
        if vl.kind(bridge.hf_pretrained.config) is not None:
            raise ConfigError(
                "algo=ppo with trainer=megatron: the critic of a vision-language model is not "
                "built (its value head would sit inside the language model of megatron's VL "
                "wrapper, untested); use trainer=torch (docs/algorithms.md#ppo-with-a-critic)")
        self.cfg = cfg
        self.lr = critic_lr(cfg)
        # constant lr, nothing frozen (as the torch critic); the rest is the policy's layout
        trainer = dataclasses.replace(cfg.trainer, lr=self.lr, lr_schedule="constant",
                                      warmup_steps=0, freeze_modules=[])
        self.mm = MegatronModel(cfg.model, trainer, bridge=bridge, adapt=attach_value_heads)

    def _run(self, mbs: list[MicroBatch], width: int, loss_of: LossOf,
             forward_only: bool) -> None:
        """Megatron's schedule over the micro-batches; `loss_of(row, mb)` gives each one's
        loss function of the chunk's output [B, T, 1]."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        starts = [sum(len(m) for m in mbs[:i]) for i in range(len(mbs))]

        def forward_step(data_iterator, chunk):
            row, mb = next(data_iterator)
            out = self.mm.forward(chunk, mb.input_ids, attention_mask=mb.attention_mask)
            return out, loss_of(row, mb)

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(list(zip(starts, mbs))),
            model=self.mm.chunks, num_microbatches=len(mbs),
            seq_length=self.mm.seq_length(width, 1), micro_batch_size=len(mbs[0]),
            forward_only=forward_only)

    @torch.no_grad()
    def values(self, block: MicroBatch) -> Tensor:
        """V at every position predicting a token, [rows, T-1] (aligned with `targets`), from
        a forward-only pass in micro-batches (each cut to its longest row)."""
        out = torch.zeros_like(block.weights)

        def loss_of(row: int, mb: MicroBatch):
            def collect(output: Tensor):
                v = _values(output, mb)
                out[row:row + len(mb), :v.shape[1]] = v
                return v.new_zeros(()), {}
            return collect

        self.mm.train()  # the mode its update runs in (no dropout either way)
        self._run(micro_batches(block, self.cfg.trainer.micro_batch_size, False),
                  block.input_ids.shape[1], loss_of, forward_only=True)
        return out

    def prepare(self, blocks: Iterable[tuple[MicroBatch, bool]],
                reward_kl: RewardKL | None) -> Blocks:
        """This rank's block with GAE advantages whitened over the whole batch: the moments
        summed over the data-parallel group (TP peers hold the same rows)."""
        from megatron.core import parallel_state as ps

        [(block, last)] = list(blocks)
        values = self.values(block)
        kl = reward_kl(block) if reward_kl is not None else None
        group = ps.get_data_parallel_group()

        def reduce(t: Tensor) -> Tensor:
            dist.all_reduce(t, group=group)
            return t

        return [(with_gae(block, values, kl, self.cfg.algo, reduce), last)]

    def update(self, blocks: Blocks, num_steps: int) -> dict[str, float]:
        """The clipped value loss over this rank's rows, weighted like the policy's loss, in
        `num_steps` mini-batches with one optimizer step each; `critic/*` metrics counted on
        TP rank 0 of each data-parallel rank."""
        from megatron.core import parallel_state as ps

        [(block, _)] = blocks
        self.mm.train()
        self.mm.set_lr()
        dp, counted = ps.get_data_parallel_world_size(), ps.get_tensor_model_parallel_rank() == 0
        clip, size = self.cfg.algo.value_clip, self.cfg.trainer.micro_batch_size
        sums = zero_sums(block.weights.device)
        norms = []
        for _, mini in mini_batches(block, num_steps):
            for chunk in self.mm.chunks:
                chunk.zero_grad_buffer()
            self.mm.optimizer.zero_grad()
            mbs = micro_batches(mini, size, False)
            # the schedule divides by the micro-batch count, DDP averages over data-parallel
            # ranks; each mini-batch's weights sum to 1 / num_steps of the batch's
            scale = len(mbs) * dp * num_steps

            def loss_of(_: int, mb: MicroBatch):
                def loss_func(output: Tensor):
                    loss, clipped = value_loss(_values(output, mb), mb.old_values, mb.returns,
                                               clip)
                    if counted:
                        add_sums(sums, loss, clipped, mb)
                    return (loss * mb.weights).sum() * scale, {}
                return loss_func

            self._run(mbs, mini.input_ids.shape[1], loss_of, forward_only=False)
            _, grad_norm, _ = self.mm.optimizer.step()
            norms.append(float(grad_norm or 0.0))
        return reduce_sums(sums) | {"critic/grad_norm": sum(norms) / len(norms),
                                    "critic/lr": self.lr}


def _values(output: Tensor, mb: MicroBatch) -> Tensor:
    """The head's output [B, T', 1] (T' >= T under sequence parallelism's padding) -> the
    values at the positions predicting the micro-batch's targets, [B, T-1], float32."""
    return output[:, :mb.input_ids.shape[1] - 1, 0].float()


def reward_kl(cfg: TrainConfig, mm: MegatronModel) -> RewardKL:
    """Per-token KL of the sampling-time policy to the reference, [rows, T-1]
    (algo.kl_loss_type): the policy's log-probs before the step from a forward-only pass
    (old_logprobs=recompute), or the engine's (rollout); the reference's from the rows
    (`ref_logp`, computed before the step: megatron/reference.py, or model.lora's policy with
    its adapters off)."""

    algo, temp, size = cfg.algo, cfg.rollout.temperature, cfg.trainer.micro_batch_size

    @torch.no_grad()
    def block_kl(block: MicroBatch) -> Tensor:
        old = (block.rollout_logp if algo.old_logprobs == "rollout"
               else with_old_logprobs(mm, block, algo, 1, size, temp).old_logp)
        kl = torch.zeros_like(block.weights)
        for lo in range(0, len(block), size):
            mb = block.rows(lo, lo + size)
            width = mb.targets.shape[1]
            kl[lo:lo + len(mb), :width] = kl_penalty(
                old[lo:lo + len(mb), :width], mb.ref_logp, algo.kl_loss_type)
        return kl

    return block_kl
