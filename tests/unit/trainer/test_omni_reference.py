"""The KL reference of a Qwen3-Omni run under trainer=megatron (`omni.load_reference`, issue
#38): the whole model has no forward, so the reference loaded as for other models failed at its
first micro-batch; it is now the thinker alone (no talker, no code2wav built), scoring tokens as
transformers' thinker does, refreshed by the policy export's `thinker.*` names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers_tiny import make_tiny_omni

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> Path:
    return make_tiny_omni(tmp_path_factory.mktemp("omni_ref"))


def batch(omni: Path, response: list[list[int]]) -> dict[str, torch.Tensor]:
    """An image row and an audio row (prompt: marker, pads, end marker, '='), each followed by
    its `response`, right-padded, with their media tensors."""
    from transformers import AutoTokenizer

    from relax_slurm.data.media import MediaRef
    from relax_slurm.data.processor import MediaProcessor, concat_tensors

    model = omni / "model"
    tok = AutoTokenizer.from_pretrained(model)
    mp = MediaProcessor(model, tok.get_vocab())
    eq = tok("=", add_special_tokens=False)["input_ids"]
    rows, tensors = [], []
    for kind, folder, glob in (("image", "colors", "*.png"), ("audio", "tones", "*.wav")):
        start, pad, end = (tok.convert_tokens_to_ids(t) for t in mp.markers[kind])
        ref = MediaRef(kind=kind, path=str(next((omni / folder).glob(glob))))
        out = mp.process([start, pad, end] + eq, {kind: [ref]})
        rows.append(out.input_ids)
        tensors.append(out.tensors)
    rows = [r + resp for r, resp in zip(rows, response)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    media = {k: torch.from_numpy(v) for k, v in concat_tensors(tensors).items()}
    return {"input_ids": ids, "attention_mask": mask, **media}


def test_the_reference_is_the_thinker_alone_and_scores_as_transformers(omni: Path) -> None:
    from safetensors.torch import load_file

    from relax_slurm.config.model import ModelConfig
    from relax_slurm.modeling import NOT_SERVED, auto_model_class
    from relax_slurm.trainer.megatron import omni as omni_mod
    from relax_slurm.weightsync.receiver import load_named_tensors

    model = omni / "model"
    ref = omni_mod.load_reference(ModelConfig(path=str(model)), torch.device("cpu"))
    names = [n for n, _ in ref.named_parameters()]
    assert names and all(n.startswith("thinker.") for n in names)  # no talker, no code2wav
    assert not any(p.requires_grad for p in ref.parameters())

    whole = auto_model_class(model).from_pretrained(model, dtype=torch.float32).eval()
    kw = batch(omni, [[5, 6], [7]])
    with torch.no_grad():
        want = whole.thinker(**kw).logits
        got = ref(**kw).logits
    mask = kw["attention_mask"].bool()
    assert torch.allclose(got[mask], want[mask], rtol=0, atol=1e-5)

    # a response holding a start marker (only pads are never sampled) is scored, the marker
    # counted as text (transformers 5.x's own positions raise IndexError on this batch)
    cfg = whole.thinker.config
    sampled = batch(omni, [[cfg.audio_start_token_id, 5], [cfg.audio_start_token_id,
                                                          cfg.vision_start_token_id]])
    with torch.no_grad():
        assert torch.isfinite(ref(**sampled).logits).all()

    # refreshed from the policy by the files' names (what the bridge's export gives)
    on_file = load_file(str(model / "model.safetensors"))
    thinker = {n: t + 0.5 for n, t in on_file.items() if not n.startswith(NOT_SERVED)}
    load_named_tensors(ref, thinker.items())
    lm_head = dict(ref.named_parameters())["thinker.lm_head.weight"]
    assert torch.equal(lm_head, thinker["thinker.lm_head.weight"])
