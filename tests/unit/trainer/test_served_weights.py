"""What a weight sync sends (trainer/model.py `full_named_weights`): a model's parts that no
engine uses for the policy's tokens never go (Qwen3-Omni's talker and code2wav, issue #33:
SGLang's loader drops them, and every sync broadcast them for nothing)."""

from __future__ import annotations

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
