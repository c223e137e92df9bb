"""Build the tiny Qwen3 model and character tokenizer of the embedded CPU default.

    python tools/make_tiny_model.py --out tiny/model
    python tools/make_tiny_model.py --out tiny/vl_model --kind vl        # tiny Qwen2.5-VL
    python tools/make_tiny_model.py --out tiny/vl3_model --kind vl3      # tiny Qwen3-VL
    python tools/make_tiny_model.py --out tiny/audio_model --kind audio  # tiny Qwen2-Audio
    python tools/make_tiny_model.py --out tiny/moe_model --kind moe      # tiny Qwen3-MoE

The model is a randomly initialised `Qwen3ForCausalLM` (hidden 64, 2 layers, 4 query / 2 kv
heads of 16 dims, tied embeddings, 75k parameters); the tokenizer has one token per
character of "a+b=" arithmetic plus <pad>, <eos>, <unk>. Its chat template renders messages as
their contents concatenated, so the prompt "3+4=" is exactly the ids of "3+4=" and the model
answers with "7<eos>". Everything is built locally: no hub access.

`--kind vl`, `--kind vl3` and `--kind audio` build the multimodal siblings on the same
character tokenizer (see tools/tiny_multimodal.py): a Qwen2.5-VL with a one-block vision tower
and its image processor, a Qwen3-VL likewise (patch 16, DeepStack), and a Qwen2-Audio with a
one-layer audio encoder over 2 s of 16 mel bins and its Whisper feature extractor.
`--kind moe` builds a `Qwen3MoeForCausalLM` of the same size: every layer's MLP is 16 experts of
16 dims, 4 routed per token, and its output head is its own (untied, as in Qwen's MoE
checkpoints) (the routing-replay preset, experiment=tiny_moe_cpu).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerFast

from relax_slurm.tiny.tokenizer import build_tokenizer, save_tokenizer

if TYPE_CHECKING:  # torch and the model classes take many seconds to import: build_model
    import torch  # imports them, so callers that only need the tokenizer stay fast
    from transformers import Qwen3ForCausalLM


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    experts: int = 0,
    experts_per_token: int = 2,
    expert_size: int = 32,
) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 whose special-token ids match `tokenizer`; with `experts`,
    a Qwen3-MoE whose every layer routes each token to `experts_per_token` of them."""
    import torch
    from transformers import (GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    # The tokenizer has no BOS token (as Qwen's); bos_token_id is None in both.
    special = dict(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    moe = dict(num_experts=experts, num_experts_per_tok=experts_per_token,
               moe_intermediate_size=expert_size, decoder_sparse_step=1, norm_topk_prob=True,
               router_aux_loss_coef=0.0) if experts else {}
    config = (Qwen3MoeConfig if experts else Qwen3Config)(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        # a Qwen3-MoE's head is its own, as in Qwen's MoE checkpoints (SGLang's Qwen3-MoE
        # never ties it: docs/engines.md#sglang-on-cpu); it starts as a copy of the embedding,
        # so the untrained model computes what a tied one would
        tie_word_embeddings=not experts,
        dtype="float32",
        **moe,
        **special,
    )
    torch.manual_seed(seed)
    model = (Qwen3MoeForCausalLM if experts else Qwen3ForCausalLM)(config)
    if experts:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.generation_config = GenerationConfig(**special)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def readable_as_umask(out: Path) -> None:
    """Give every file under `out` the mode the umask gives a new file (0644 under 022):
    save_pretrained writes model.safetensors through a private temporary file (0600), which
    another user of a shared tiny/ could not read."""
    umask = os.umask(0)
    os.umask(umask)
    for path in out.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write model and tokenizer")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kind", choices=["text", "moe", "vl", "vl3", "vl3moe", "audio", "omni3",
                                           "omni25"],
                        default="text", help="text: Qwen3; moe: Qwen3-MoE; vl: Qwen2.5-VL; "
                        "vl3: Qwen3-VL; vl3moe: Qwen3-VL-MoE; audio: Qwen2-Audio; omni3: "
                        "Qwen3-Omni; omni25: Qwen2.5-Omni")
    args = parser.parse_args(argv)
    if args.kind not in ("text", "moe"):
        from relax_slurm.tiny.multimodal import build_multimodal

        print(build_multimodal(args.kind, Path(args.out), seed=args.seed))
        readable_as_umask(Path(args.out))
        return 0

    tokenizer = build_tokenizer()
    model = build_model(
        tokenizer,
        hidden_size=args.hidden_size,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        seed=args.seed,
        **(dict(experts=16, experts_per_token=4, expert_size=16) if args.kind == "moe" else {}),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    readable_as_umask(out)
    print(f"wrote {out}: {type(model).__name__} with {count_parameters(model):,} parameters, "
          f"tokenizer with {len(tokenizer)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
