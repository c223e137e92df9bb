"""Tiny random multimodal models with their processors, built locally from configs (no hub).

    python tools/make_tiny_model.py --out tiny/vl_model --kind vl
    python tools/make_tiny_model.py --out tiny/audio_model --kind audio

- `vl`: `Qwen2_5_VLForConditionalGeneration` (text: hidden 64, 2 layers, M-RoPE sections
  [2, 3, 3]; vision: one block of width 32, patch 14, 2x2 merge) and a `Qwen2VLImageProcessor`
  limited to 28x28..56x56 pixels, so one image is at most 16 patches = 4 image tokens. The
  image processor is the PIL one: torchvision has no CPU build here, and the full
  `Qwen2_5_VLProcessor` needs torchvision's video processor, so it is not saved.
- `audio`: `Qwen2AudioForConditionalGeneration` (text as above; audio encoder: one layer of
  width 32 over 16 mel bins and 200 frames = 2 s) and a `Qwen2AudioProcessor` (Whisper
  feature extractor with chunk_length=2 s at 16 kHz), loadable with `AutoProcessor`.

Both share the character tokenizer of tools/make_tiny_model.py plus the model's own special
tokens (`<|vision_start|><|image_pad|><|vision_end|>`, `<|audio_bos|><|AUDIO|><|audio_eos|>`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from make_tiny_model import build_tokenizer, save_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56
AUDIO_SECONDS, MEL_BINS = 2, 16


def _text_config(tokenizer: Any, **extra: Any) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, **extra)


def _tokenizer(special: list[str]) -> Any:
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def build_vl(out: Path, seed: int = 0) -> str:
    import torch
    from transformers import (GenerationConfig, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil)

    tok = _tokenizer(VISION_TOKENS)
    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2_5_VLConfig(
        text_config=_text_config(tok, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, fullatt_block_indexes=[0], window_size=112),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
        video_token_id=video, tie_word_embeddings=True, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    return f"wrote {out}: Qwen2_5_VLForConditionalGeneration with {n:,} parameters"


def build_audio(out: Path, seed: int = 0) -> str:
    import torch
    from transformers import (GenerationConfig, Qwen2AudioConfig,
                              Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor,
                              WhisperFeatureExtractor)

    tok = _tokenizer(AUDIO_TOKENS)
    config = Qwen2AudioConfig(
        audio_config=dict(num_mel_bins=MEL_BINS, encoder_layers=1, encoder_attention_heads=2,
                          encoder_ffn_dim=64, d_model=32,
                          max_source_positions=AUDIO_SECONDS * 50),  # 100 frames/s, /2 by conv
        text_config=_text_config(tok, model_type="qwen2", tie_word_embeddings=True),
        audio_token_id=tok.convert_tokens_to_ids("<|AUDIO|>"), dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fe = WhisperFeatureExtractor(feature_size=MEL_BINS, chunk_length=AUDIO_SECONDS,
                                 sampling_rate=16000)
    Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok,
                        chat_template=tok.chat_template).save_pretrained(out)
    save_tokenizer(tok, out)  # after the processor: the tokenizer class stays loadable in 4.x
    n = sum(p.numel() for p in model.parameters())
    return f"wrote {out}: Qwen2AudioForConditionalGeneration with {n:,} parameters"


def build_multimodal(kind: str, out: Path, seed: int = 0) -> str:
    return {"vl": build_vl, "audio": build_audio}[kind](out, seed)
