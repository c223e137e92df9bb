"""trainer.logprob_chunk_size (trainer/logprob_chunks.py): the log-probs, the entropy and every
gradient of the torch step's terms equal the whole sequence's bit for bit (each term is per
position: chunks change no reduction), with the entropy's gradient or without; no float32
tensor wider than a chunk is built in the forward or the backward; the config refuses a
negative size."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.step import token_terms

B, T, V, H = 3, 23, 97, 16  # 22 positions: chunks of 5 leave a short last one


class Largest(TorchDispatchMode):
    """The largest float32 tensor (elements) any op returns, and how many returned that
    many."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.sizes.append(t.numel())
        return out


def run(chunk: int, entropy: str, banned: list[int], seen: Largest | None = None
        ) -> tuple[torch.Tensor, ...]:
    """Logits [B, T-1, V] in bf16 (a GPU run's dtype) through token_terms, a loss of both
    terms, backward: the log-probs, the entropy and the logits' gradient (all the model's
    gradients are functions of it). `seen`: watches token_terms and the backward."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(B, T - 1, V, generator=g)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (B, T - 1), generator=g)
    with seen or contextlib.nullcontext():
        logp, ent = token_terms(logits, targets, 0.7, banned, entropy, chunk)
        loss = logp.sum() + (0.1 * ent.sum() if entropy == "grad" else 0.0)
        loss.backward()
    return logp, ent, logits.grad


@pytest.mark.parametrize("entropy", ["grad", "metric"])
@pytest.mark.parametrize("chunk", [1, 5, 21])
def test_chunked_terms_and_gradients_equal_the_whole_sequences(chunk, entropy):
    banned = [3, 50]  # media pad tokens: the lowest logit in every chunk too
    whole = run(0, entropy, banned)
    chunked = run(chunk, entropy, banned)
    for name, a, b in zip(("logp", "entropy", "logits.grad"), whole, chunked):
        assert torch.equal(a, b), name


def test_no_float32_tensor_of_the_whole_logits():
    whole, chunked = Largest(), Largest()
    run(0, "grad", [], whole)
    run(5, "grad", [], chunked)
    full = B * (T - 1) * V
    # the whole sequence: the float32 copy, its softmax and the rest, in both directions
    assert whole.sizes.count(full) > 3, whole.sizes.count(full)
    # chunked: every float32 tensor is a chunk's (the logits' gradient is bf16, as they are)
    assert max(chunked.sizes) <= B * 5 * V, max(chunked.sizes)


def test_a_negative_chunk_size_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="trainer.logprob_chunk_size=-1"):
        TrainerConfig(logprob_chunk_size=-1)


def test_a_models_logprobs_without_gradients_chunked_equal_whole():
    """The passes without gradients (old log-probs, the KL reference, the reward-side KL):
    token_logprobs of a transformers model over chunks, bit for bit the whole sequence's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax_slurm.trainer.batch import MicroBatch
    from relax_slurm.trainer.step import token_logprobs

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=0)).eval()
    ids = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(1))
    zeros = torch.zeros(B, T - 1)
    mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), targets=ids[:, 1:],
                    weights=zeros, advantages=zeros, rollout_logp=zeros, seq_lens=(T,) * B)
    with torch.no_grad():
        whole = token_logprobs(model, mb, 0.7)
        assert torch.equal(token_logprobs(model, mb, 0.7, chunk=5), whole)
