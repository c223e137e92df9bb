"""trainer=torch with model.dtype=bfloat16: float32 master weights, bf16 compute.

AdamW on bf16 parameters loses most updates at RL learning rates: a step of lr 1e-6 is far
below bf16's resolution of a weight of ~0.02 (2**-8 of it, ~8e-5), so the weight rounds back to
itself. The trained model keeps float32 weights and computes in bf16 under autocast; the engines
get bf16 (what they serve)."""

from __future__ import annotations

import torch

from relax_slurm.config.model import ModelConfig
from relax_slurm.trainer.model import full_named_weights, load_hf_model

CPU = torch.device("cpu")


def tiny(tmp_path):
    from relax_slurm.tiny.model import main

    out = tmp_path / "model"
    assert main(["--out", str(out)]) == 0
    return ModelConfig(path=str(out), dtype="bfloat16")


def test_a_bf16_run_updates_float32_master_weights_at_an_rl_lr(tmp_path):
    cfg = tiny(tmp_path)
    model = load_hf_model(cfg, CPU, trained=True)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, 16, (2, 12))
    logits = model(input_ids=ids).logits  # [2, 12, V]
    assert logits.dtype == torch.bfloat16  # the compute dtype is the configured one
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                                             ids[:, 1:].flatten())
    loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    opt.step()
    moved = total = 0
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        has_grad = p.grad != 0
        moved += int(((p.detach() != before[n]) & has_grad).sum())
        total += int(has_grad.sum())
    # Adam's first step moves every element with a gradient by ~lr; in bf16 nearly none moves
    assert total > 0 and moved / total > 0.99, (moved, total)


def test_the_engines_get_the_served_dtype(tmp_path):
    cfg = tiny(tmp_path)
    model = load_hf_model(cfg, CPU, trained=True)
    sent = dict(full_named_weights(model, torch.bfloat16))
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}
    name, p = next(iter(model.named_parameters()))
    assert torch.equal(sent[name], p.detach().to(torch.bfloat16))
    # a frozen copy (the reference) keeps the configured dtype: it only runs forward
    ref = load_hf_model(cfg, CPU)
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
