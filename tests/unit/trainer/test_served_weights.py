"""What a weight sync sends (trainer/model.py `full_named_weights`): a model's parts that no
engine uses for the policy's tokens never go (Qwen3-Omni's talker and code2wav, issue #33:
SGLang's loader drops them, and every sync broadcast them for nothing)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from relax_slurm.trainer.model import full_named_weights


class OmniShaped(nn.Module):
    """The top-level layout of Qwen3OmniMoeForConditionalGeneration, in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.thinker = nn.ModuleDict({"lm_head": nn.Linear(4, 6, bias=False),
                                      "audio_tower": nn.Linear(3, 4)})
        self.talker = nn.Linear(4, 4)
        self.code2wav = nn.Linear(4, 2)


def test_the_talker_and_code2wav_are_never_sent():
    model = OmniShaped()
    sent = dict(full_named_weights(model, torch.bfloat16))
    assert sorted(sent) == ["thinker.audio_tower.bias", "thinker.audio_tower.weight",
                            "thinker.lm_head.weight"]
    assert all(t.dtype == torch.bfloat16 for t in sent.values())
    # a name that merely contains the word is the thinker's own
    model.thinker["talker_gate"] = nn.Linear(2, 2)
    assert "thinker.talker_gate.weight" in dict(full_named_weights(model))


def test_a_real_qwen3_omni_is_sent_under_its_checkpoint_names(tmp_path):
    """The tiny Qwen3-Omni (thinker + talker + code2wav), loaded as the trainer loads it:
    transformers 5 holds the thinker as `thinker.model.{audio_tower,visual,language_model}.*`
    (5.24, which the suite runs; 5.20, the last release for Python 3.10, as the files do)
    with fused experts, the files (and so SGLang's loader, qwen3_omni_moe.py) say
    `thinker.audio_tower.*`, `thinker.visual.*`, `thinker.model.layers.N.mlp.experts.E.*`;
    SGLang renames none of `thinker.model.audio_tower.*`, so that tower was never updated.
    What goes is exactly the files' thinker, bit for bit; the hf engine takes those names."""
    from safetensors.torch import load_file

    from relax_slurm.config.model import ModelConfig
    from relax_slurm.tiny.multimodal import build_omni3
    from relax_slurm.trainer.model import load_hf_model
    from relax_slurm.weightsync.receiver import load_named_tensors

    build_omni3(tmp_path / "omni")
    model = load_hf_model(ModelConfig(path=str(tmp_path / "omni")), torch.device("cpu"),
                          trained=True)
    on_file = load_file(str(tmp_path / "omni" / "model.safetensors"))
    sent = dict(full_named_weights(model))
    thinker = {n: t for n, t in on_file.items() if n.startswith("thinker.")}
    assert sorted(sent) == sorted(thinker)
    assert {n.split(".")[1] for n in sent} == {"audio_tower", "visual", "model", "lm_head"}
    assert all(torch.equal(sent[n], thinker[n]) for n in sent)

    # received under those names, every tensor lands, the fused experts' included
    new = {n: torch.full_like(t, 0.25) for n, t in thinker.items()}
    load_named_tensors(model, new.items())
    assert all(torch.equal(t, new[n]) for n, t in full_named_weights(model))


def test_the_omni_presets_frozen_towers_are_found_by_their_file_names(tmp_path):
    """qwen3_omni_30b_a3b_avqa freezes `[thinker.audio_tower, thinker.visual]`, the names of
    the checkpoint files; transformers 5.24 holds them under `thinker.model.*` (5.20 as the files
    name them), and a prefix that matched nothing stopped the run at start."""
    from omegaconf import OmegaConf

    from relax_slurm.config.model import ModelConfig
    from relax_slurm.tiny.multimodal import build_omni3
    from relax_slurm.trainer.model import freeze_modules, load_hf_model

    import relax_slurm

    conf = Path(relax_slurm.__file__).parent / "conf"
    preset = OmegaConf.load(conf / "experiment" / "qwen3_omni_30b_a3b_avqa.yaml")
    prefixes = list(preset.trainer.freeze_modules)
    build_omni3(tmp_path / "omni")
    model = load_hf_model(ModelConfig(path=str(tmp_path / "omni")), torch.device("cpu"))
    towers = {n: p for n, p in model.named_parameters()
              if n.startswith(("thinker.model.audio_tower.", "thinker.model.visual.",
                               "thinker.audio_tower.", "thinker.visual."))}
    assert freeze_modules(model, prefixes) == sum(p.numel() for p in towers.values()) > 0
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(towers)
