"""SFT rows -> the trainer's MicroBatch (prompt positions weigh 0), its loss through the shared
token_loss and train_step, the validation forward, and scatter on one gloo rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.data.sft import SFTExample
from relax_slurm.errors import ConfigError
from relax_slurm.trainer.batch import collate, loss_params
from relax_slurm.trainer.model import build_optimizer, single_process_group
from relax_slurm.trainer.sft import check_length, padded, scatter_rows, train_items
from relax_slurm.trainer.step import nll_sums, token_loss, token_terms, train_step

VOCAB = 16
SFT = AlgoConfig(name="sft", tis_clip=None, loss_reduction="token_mean")


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    with single_process_group():
        yield


def example(prompt, response, mask=None) -> SFTExample:
    return SFTExample(prompt_ids=np.array(prompt), response_ids=np.array(response),
                      loss_mask=np.array(mask or [1.0] * len(response), dtype=np.float32))


ROWS = [example([5, 6, 7], [8, 1]),                       # P=3, R=2
        example([9], [4, 5, 6, 1], [1.0, 0.0, 1.0, 1.0])]  # a context token inside the response


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=0))


def test_only_response_tokens_are_weighted_each_one_over_the_batch_tokens():
    mb = collate(train_items(ROWS, "token_mean"), 0, torch.device("cpu"))
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 1], [9, 4, 5, 6, 1]]
    # position t predicts token t+1: row 0's targets 8 and 1 sit at positions 2 and 3
    assert mb.targets.tolist() == [[6, 7, 8, 1], [4, 5, 6, 1]]
    w = 1 / 5  # five trained tokens in the batch
    assert torch.allclose(mb.weights, torch.tensor([[0, 0, w, w], [w, 0, w, w]]))
    assert mb.weights.sum().item() == pytest.approx(1.0)


def test_loss_is_the_token_mean_nll_of_the_trained_tokens():
    mb = collate(train_items(ROWS, "token_mean"), 0, torch.device("cpu"))
    logits = torch.randn(2, 4, VOCAB, generator=torch.Generator().manual_seed(1))
    logp, entropy = token_terms(logits, mb.targets, 1.0, [], "metric")
    loss, metrics = token_loss(logp, entropy, mb, SFT, loss_params(SFT), None)
    logp = torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None])[..., 0]
    trained = [logp[0, 2], logp[0, 3], logp[1, 0], logp[1, 2], logp[1, 3]]
    assert loss.item() == pytest.approx(-sum(trained).item() / 5, rel=1e-6)
    assert metrics["tokens"].item() == 5


def test_train_step_lowers_the_nll_and_the_validation_forward_agrees_with_it():
    model = tiny_model()
    items = train_items(ROWS, "token_mean")
    mb = collate(items, 0, torch.device("cpu"))
    before = nll_sums(model, mb, micro_batch_size=1)
    assert before["tokens"] == 5
    opt, sched = build_optimizer(model, TrainerConfig(lr=1e-2))
    out = train_step(model, opt, sched, [(mb, True)], SFT, micro_batch_size=1, grad_clip=1.0,
                     temperature=1.0)
    # train/loss is the loss before the update: the validation forward's mean on the same rows
    assert out["train/loss"] == pytest.approx(before["nll"] / 5, rel=1e-5)
    for _ in range(5):
        train_step(model, opt, sched, [(mb, True)], SFT, micro_batch_size=1, grad_clip=1.0,
                   temperature=1.0)
    assert nll_sums(model, mb, micro_batch_size=2)["nll"] < before["nll"]


def test_validation_rows_are_padded_with_rows_that_train_nothing():
    rows = padded(ROWS[:1], 4)
    assert len(rows) == 4 and [r.loss_mask.sum() for r in rows] == [2.0, 0.0, 0.0, 0.0]
    block = scatter_rows(rows, "token_sum", 0, torch.device("cpu"), [0])
    assert (block.weights != 0).sum().item() == 2


def test_more_steps_than_the_epochs_hold_is_refused():
    from relax_slurm.config.data import DataConfig
    from relax_slurm.config.schema import TrainConfig
    from relax_slurm.config.sft import SFTConfig

    cfg = TrainConfig(run_dir="r", algo=SFT, data=DataConfig(train_files=["x"], num_epochs=2),
                      sft=SFTConfig(batch_size=10), trainer=TrainerConfig(total_steps=5))
    check_length(cfg, 25)  # 50 rows in 2 passes over 25
    with pytest.raises(ConfigError, match="data.num_epochs=2"):
        check_length(cfg, 24)
