"""The RoPE base the megatron backend gives megatron-core (trainer/megatron/model.py rope_theta).

megatron-bridge 0.3.1 maps the HF config field `rope_theta`, which transformers 5 moved into
`rope_parameters`; read from the wrong place it silently became megatron-core's default 10000.
The logits comparisons in tests/integration/test_megatron_parallel.py run a model whose base is
1e6 for the same reason.
"""

from __future__ import annotations

from transformers import Qwen2_5_VLConfig, Qwen3Config

from relax_slurm.trainer.megatron.model import rope_theta


def test_rope_theta_from_rope_parameters():
    assert rope_theta(Qwen3Config(rope_parameters={"rope_type": "default",
                                                   "rope_theta": 1e6})) == 1e6


def test_rope_theta_of_a_vl_model_from_its_text_config():
    cfg = Qwen2_5_VLConfig(text_config={"rope_parameters": {
        "rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3]}})
    assert rope_theta(cfg) == 5e5
