"""The character tokenizer of the tiny models (relax_slurm/tiny/model.py and its multimodal
siblings, multimodal.py): one token per character of "a+b=" arithmetic plus <pad>, <eos>,
<unk>, and a chat template that renders messages as their contents concatenated.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]  # ids 0, 1, 2
CHARS = list("0123456789+-*= ")

# System, user and tool turns render as their content; assistant turns end with EOS (that is
# what the model learns to emit); the generation prompt adds nothing.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def build_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, special tokens first."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split every character into its own word (spaces included) ...
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # ... and glue them back without the spaces WordLevel would put between tokens.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="left",  # batched generation pads prompts on the left
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # transformers 5 records its internal class name (TokenizersBackend), which 4.x cannot
    # load; PreTrainedTokenizerFast loads in both.
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")
