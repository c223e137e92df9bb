"""`model`: the Hugging Face model trainer and engines load, and `model.lora` (docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from relax_slurm.config.check import check

LORA_SYNCS = ("auto", "adapter", "merged")
SGLANG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa",
                       "q_b_proj", "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj",
                       "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens",
                       "lm_head", "qkvr", "wo_ud")
"""The modules SGLang 0.5.23 serves adapters on (its SUPPORTED_LORA_TARGET_MODULES)."""
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]


@dataclass(kw_only=True)
class LoraConfig:
    """`model.lora`: train low-rank adapters (PEFT's LoRA) on a frozen model.path instead of
    every weight. Off while rank is 0."""

    rank: int = 0
    """LoRA rank r of every adapted matrix; 0: off (full fine-tuning)."""
    alpha: float = 16.0
    """lora_alpha: the adapter's update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0: the trainer's log-probs are the
    engines' exactly)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Names of the linear modules that get an adapter (PEFT's target_modules)."""
    lr: float | None = None
    """The policy's learning rate while LoRA is on; null: trainer.lr. Adapters start at zero and
    are a few percent of the weights, so they usually want a larger lr than full fine-tuning;
    a preset can set both and serve either (tiny_cpu: 2e-3 full, 1e-2 LoRA)."""
    sync: str = "auto"
    """What each weight sync sends: auto (the adapter alone where the engines serve adapters,
    else the merged weights, said once at start), adapter (refused where they cannot), or
    merged (base + adapter as full weights, as a full fine-tuning run sends)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def policy_lr(self, trainer_lr: float) -> float:
        """The policy optimizer's base lr: this lr while LoRA is on and it is set."""
        return self.lr if self.enabled and self.lr is not None else trainer_lr

    def __post_init__(self) -> None:
        check(self.rank >= 0, f"model.lora.rank={self.rank}: >= 0 (0 turns LoRA off)")
        check(self.alpha > 0, f"model.lora.alpha={self.alpha}: must be > 0 (the update is "
              "scaled by alpha / rank; 2 x rank is usual)")
        check(self.lr is None or self.lr > 0,
              f"model.lora.lr={self.lr}: must be > 0, or null (trainer.lr)")
        check(0.0 <= self.dropout < 1.0, f"model.lora.dropout={self.dropout}: in [0, 1)")
        check(not self.enabled or bool(self.target_modules),
              "model.lora.target_modules is empty: name the linear modules to adapt, e.g. "
              f"model.lora.target_modules=[{','.join(DEFAULT_LORA_TARGETS[:4])}]")
        check(self.sync in LORA_SYNCS,
              f"model.lora.sync={self.sync!r}: use one of {', '.join(LORA_SYNCS)}")


@dataclass(kw_only=True)
class ModelConfig:
    path: str = MISSING
    """A Hugging Face model directory (config.json, weights, tokenizer), read with
    from_pretrained."""
    dtype: str = "float32"
    """Parameter dtype for trainer and engines: float32, bfloat16 or float16."""
    trust_remote_code: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (docs/lora.md)."""

    def __post_init__(self) -> None:
        check(self.dtype in ("float32", "bfloat16", "float16"),
               f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")
