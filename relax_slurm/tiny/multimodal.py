"""Tiny random multimodal models with their processors, built locally from configs (no hub).

    python tools/make_tiny_model.py --out tiny/vl_model --kind vl
    python tools/make_tiny_model.py --out tiny/vl3_model --kind vl3
    python tools/make_tiny_model.py --out tiny/vl3moe_model --kind vl3moe
    python tools/make_tiny_model.py --out tiny/audio_model --kind audio
    python tools/make_tiny_model.py --out tiny/omni3_model --kind omni3
    python tools/make_tiny_model.py --out tiny/omni25_model --kind omni25

- `vl`: `Qwen2_5_VLForConditionalGeneration` (text: hidden 64, 2 layers, M-RoPE sections
  [2, 3, 3]; vision: one block of width 32, patch 14, 2x2 merge) and a `Qwen2VLImageProcessor`
  limited to 28x28..56x56 pixels, so one image is at most 16 patches = 4 image tokens. The
  image processor is the PIL one: torchvision has no CPU build here, and the full
  `Qwen2_5_VLProcessor` needs torchvision's video processor, so it is not saved.
- `vl3`: `Qwen3VLForConditionalGeneration` (text as above with interleaved M-RoPE sections
  [4, 2, 2] over head_dim 16; vision: one block of width 32, patch 16, 2x2 merge, a 4x4 learned
  position grid, DeepStack from block 0) and the same PIL image processor with Qwen3-VL's
  patch 16 and mean/std 0.5, limited to 32x32..64x64 pixels (at most 16 patches = 4 image
  tokens). Its tokenizer also has the characters of the "<t seconds>" text Qwen3-VL puts
  before each frame pair of a video; its vocab_size is 32, one past the tokenizer's 31, so the
  embedding splits over TP=2 under trainer=megatron. Qwen3-VL's full processor
  (`Qwen3VLProcessor`) needs torchvision's video processor too, so it is not saved either.
- `vl3moe`: `Qwen3VLMoeForConditionalGeneration`, `vl3` with every text layer's MLP replaced
  by 4 experts of width 16, top-2 (transformers 5 holds them fused, `mlp.experts.gate_up_proj`
  [4, 32, 64]; the file keeps Qwen's layout [4, 64, 32], transposed on load and save), no
  load-balancing loss; same tokenizer and image processor as `vl3`.
- `audio`: `Qwen2AudioForConditionalGeneration` (text as above, vocab_size 22, one past the
  tokenizer's 21, for TP=2 under trainer=megatron; audio encoder: one layer of width 32 over 16
  mel bins and 200 frames = 2 s) and a `Qwen2AudioProcessor` (Whisper
  feature extractor with chunk_length=2 s at 16 kHz), loadable with `AutoProcessor`.
- `omni3`: `Qwen3OmniMoeForConditionalGeneration`, the whole model as Qwen3-Omni ships: a thinker
  (text: hidden 32, 2 layers of 4 experts of width 16, top-2, M-RoPE [2, 1, 1] interleaved over
  head_dim 8; one-layer audio encoder of width 16 over 16 mel bins, in Qwen3-Omni's 100-frame
  windows of 13 tokens, whose start marker `audio_start_token_id` is the tokenizer's
  `<|audio_bos|>`; one-block vision encoder)
  plus the speech talker and code2wav (one layer each), which RL never trains or sends. Its
  `preprocessor_config.json` is the released Qwen3-Omni's kind: one file holding the image
  processor's keys (`vl3`'s: patch 16, 2x2 merge, 32x32..64x64 pixels) and the Whisper
  feature extractor's (`audio`'s: 16 mel bins, 2 s at 16 kHz), with `processor_class`
  `Qwen3OmniMoeProcessor`; `AutoImageProcessor` and `AutoFeatureExtractor` each read their
  part (Qwen3-Omni's full processor needs torchvision's video processor, which CPU machines
  lack; `data/processor.py` falls back to those two). Transformers 5 renames the thinker's
  parts in memory, `thinker.model.audio_tower.*`, while the files and SGLang say
  `thinker.audio_tower.*`.
- `omni25`: `Qwen2_5OmniForConditionalGeneration`, the whole model as Qwen2.5-Omni ships: a
  thinker (text: Qwen2's layout, hidden 32, 2 layers, sectioned M-RoPE [1, 1, 2] over head_dim
  8, vocabulary rounded up to even for TP=2; one-layer audio encoder of width 16 over 16 mel
  bins in 100-frame windows, Qwen2-Audio's token count; one-block vision encoder of patch 14,
  2x2 merge), a one-layer talker and a tiny token2wav (DiT + BigVGAN), `spk_dict.pt` (one
  speaker, which transformers' from_pretrained always loads), Qwen2.5-Omni's own media tokens
  (`<|vision_bos|><|IMAGE|><|vision_eos|>`, `<|VIDEO|>`, `<|audio_bos|><|AUDIO|><|audio_eos|>`)
  and a `preprocessor_config.json` of `omni3`'s kind with `vl`'s image processor (patch 14,
  28x28..56x56 pixels) and `processor_class` `Qwen2_5OmniProcessor`.

All share the character tokenizer of relax_slurm/tiny/tokenizer.py plus the model's own special
tokens (`<|vision_start|><|image_pad|><|vision_end|>`, `<|audio_bos|><|AUDIO|><|audio_eos|>`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_slurm.tiny.tokenizer import build_tokenizer, save_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56
TIMESTAMP_CHARS = "<>.secodn"  # Qwen3-VL writes "<1.5 seconds>" before each frame pair of a video
VL3_MIN_PIXELS, VL3_MAX_PIXELS = 32 * 32, 64 * 64  # Qwen3-VL: patch 16 x merge 2 = 32 pixels
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


def _save(model_cls, config, tok, out: Path, seed: int, processor=None) -> str:
    """A seeded random `model_cls(config)` saved with `tok` (and `processor`, saved before the
    tokenizer: the tokenizer class stays loadable in transformers 4.x); a line saying so."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if processor is not None:
        processor.save_pretrained(out)
    save_tokenizer(tok, out)
    n = sum(p.numel() for p in model.parameters())
    return f"wrote {out}: {model_cls.__name__} with {n:,} parameters"


def build_vl(out: Path, seed: int = 0) -> str:
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    tok = _tokenizer(VISION_TOKENS)
    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2_5_VLConfig(
        text_config=_text_config(tok, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, fullatt_block_indexes=[0], window_size=112),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
        video_token_id=video, tie_word_embeddings=True, dtype="float32")
    return _save(Qwen2_5_VLForConditionalGeneration, config, tok, out, seed,
                 Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))


def build_vl3(out: Path, seed: int = 0) -> str:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    return _build_qwen3_vl(Qwen3VLConfig, Qwen3VLForConditionalGeneration, {}, out, seed)


def build_vl3moe(out: Path, seed: int = 0, deepstack_layers: int = 1) -> str:
    """`deepstack_layers`: vision blocks, each feeding the decoder a DeepStack feature (Qwen's
    Qwen3-VL-MoE checkpoints have 3, which SGLang's Qwen3-VL-MoE assumes)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    # expert width 16: gate_up 2 x 16 = 32 differs from hidden 64, so transformers' transpose
    # between file and memory layouts (check_dims) cannot mistake one for the other
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               decoder_sparse_step=1, router_aux_loss_coef=0.0)
    return _build_qwen3_vl(Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, moe, out, seed,
                           deepstack_layers)


def _build_qwen3_vl(config_cls, model_cls, text_extra: dict, out: Path, seed: int,
                    deepstack_layers: int = 1) -> str:
    from transformers import Qwen2VLImageProcessorPil

    tok = _tokenizer(VISION_TOKENS)
    tok.add_tokens(list(TIMESTAMP_CHARS))  # after the markers: their ids stay those of `vl`
    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    # mrope_section: how many of the head_dim/2 = 8 rotary frequencies carry time, height and
    # width (interleaved, as Qwen3-VL-4B's [24, 20, 20] of 64)
    # vocab rounded up to even (32 > the tokenizer's 31): trainer=megatron splits the
    # embedding over tensor_parallel_size=2 unpadded; ids past the tokenizer are never sampled
    text = _text_config(tok, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
        "mrope_interleaved": True}, **text_extra)
    text["vocab_size"] += text["vocab_size"] % 2
    config = config_cls(
        text_config=text,
        vision_config=dict(depth=deepstack_layers, hidden_size=32, intermediate_size=64,
                           num_heads=2, out_hidden_size=64, patch_size=16,
                           num_position_embeddings=16,
                           deepstack_visual_indexes=list(range(deepstack_layers))),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
        video_token_id=video, tie_word_embeddings=True, dtype="float32")
    return _save(model_cls, config, tok, out, seed,
                 Qwen2VLImageProcessorPil(patch_size=16, min_pixels=VL3_MIN_PIXELS,
                                          max_pixels=VL3_MAX_PIXELS,
                                          image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]))


def build_audio(out: Path, seed: int = 0) -> str:
    from transformers import (Qwen2AudioConfig, Qwen2AudioForConditionalGeneration,
                              Qwen2AudioProcessor, WhisperFeatureExtractor)

    tok = _tokenizer(AUDIO_TOKENS)
    config = Qwen2AudioConfig(
        audio_config=dict(num_mel_bins=MEL_BINS, encoder_layers=1, encoder_attention_heads=2,
                          encoder_ffn_dim=64, d_model=32,
                          max_source_positions=AUDIO_SECONDS * 50),  # 100 frames/s, /2 by conv
        # untied, as transformers builds it (it ties by the top-level config, unset here) and
        # saves it; SGLang ties by text_config's key and served a head the files did not hold.
        # vocab rounded up to even (22 > the tokenizer's 21), as vl3's: trainer=megatron
        # splits the embedding over tensor_parallel_size=2 unpadded
        text_config={**_text_config(tok, model_type="qwen2", tie_word_embeddings=False),
                     "vocab_size": len(tok) + len(tok) % 2},
        audio_token_id=tok.convert_tokens_to_ids("<|AUDIO|>"), dtype="float32")
    fe = WhisperFeatureExtractor(feature_size=MEL_BINS, chunk_length=AUDIO_SECONDS,
                                 sampling_rate=16000)
    return _save(Qwen2AudioForConditionalGeneration, config, tok, out, seed,
                 Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok,
                                     chat_template=tok.chat_template))


def build_omni3(out: Path, seed: int = 0, deepstack_layers: int = 1) -> str:
    """`deepstack_layers`: vision blocks, each feeding the decoder a DeepStack feature (Qwen's
    Qwen3-Omni has 3, which SGLang's assumes)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    tok = _tokenizer(VISION_TOKENS + AUDIO_TOKENS)
    start, end, image, video, audio_start, audio, _ = tok.convert_tokens_to_ids(
        VISION_TOKENS + AUDIO_TOKENS)
    vocab = len(tok) + len(tok) % 2
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    text = dict(small, vocab_size=vocab, num_hidden_layers=2, moe_intermediate_size=16,
                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=0.0, max_position_embeddings=512,
                # transformers' Qwen3-Omni always interleaves; SGLang reads mrope_interleaved
                # (else sectioned M-RoPE), as Qwen's released config.json carries it
                rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1],
                              "interleaved": True, "mrope_interleaved": True})
    thinker = dict(
        text_config=text,
        audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2,
                          encoder_ffn_dim=32, output_dim=32, num_mel_bins=MEL_BINS,
                          downsample_hidden_size=8, n_window=50, n_window_infer=100),
        vision_config=dict(depth=deepstack_layers, hidden_size=16, intermediate_size=32,
                           num_heads=2, out_hidden_size=32, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2,
                           deepstack_visual_indexes=list(range(deepstack_layers))),
        audio_token_id=audio, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end,
        # M-RoPE finds an audio by its start marker (get_rope_index): the tokenizer's, not the
        # config's default id of the real vocabulary
        audio_start_token_id=audio_start)
    talker = dict(
        text_config=dict(small, vocab_size=64, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, num_experts=2,
                         num_experts_per_tok=1),
        code_predictor_config=dict(small, vocab_size=64),
        thinker_hidden_size=32, spatial_merge_size=2)
    code2wav = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, codebook_size=64, intermediate_size=64,
                    decoder_dim=32, upsample_rates=[2], upsampling_ratios=[2])
    config = Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker,
                                code2wav_config=code2wav, enable_audio_output=True)
    line = _save(Qwen3OmniMoeForConditionalGeneration, config, tok, out, seed)
    _save_omni_preprocessor(out)
    _name_omni_tokens(out)
    return line


def _name_omni_tokens(out: Path, tokens: list[str] = VISION_TOKENS + AUDIO_TOKENS) -> None:
    """tokenizer_config.json's names of the media tokens (`tokens`: vision start, end, image,
    video pads, then audio start, pad, end), as Qwen's released Omni models have them:
    transformers' Omni processors read them from the tokenizer (SGLang builds them; the
    project's own processing reads the ids from config.json)."""
    import json

    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(image_token=tokens[2], video_token=tokens[3], audio_token=tokens[5],
                  vision_bos_token=tokens[0], vision_eos_token=tokens[1],
                  audio_bos_token=tokens[4], audio_eos_token=tokens[6])
    path.write_text(json.dumps(config, indent=2) + "\n")


def _save_omni_preprocessor(out: Path, patch_size: int = 16,
                            pixels: tuple[int, int] = (VL3_MIN_PIXELS, VL3_MAX_PIXELS),
                            processor_class: str = "Qwen3OmniMoeProcessor",
                            mean_std: float | None = 0.5) -> None:
    """An Omni model's one preprocessor_config.json: the image processor's keys and the
    feature extractor's side by side (no key in common), as the released models' files have
    them (Qwen3-Omni's by default; Qwen2.5-Omni's: patch 14, CLIP's mean and std)."""
    import json
    import tempfile

    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    norm = {} if mean_std is None else dict(image_mean=[mean_std] * 3, image_std=[mean_std] * 3)
    parts = {"image": Qwen2VLImageProcessorPil(
                 patch_size=patch_size, min_pixels=pixels[0], max_pixels=pixels[1], **norm),
             "audio": WhisperFeatureExtractor(feature_size=MEL_BINS, chunk_length=AUDIO_SECONDS,
                                              sampling_rate=16000, return_attention_mask=True)}
    merged: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, part in parts.items():
            part.save_pretrained(Path(tmp) / name)
            keys = json.loads((Path(tmp) / name / "preprocessor_config.json").read_text())
            assert not set(keys) & set(merged), sorted(set(keys) & set(merged))
            merged.update(keys)
    merged["processor_class"] = processor_class
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, sort_keys=True)
                                                  + "\n")


# Qwen2.5-Omni's own names of the media tokens (its processor's; data/processor.py knows both)
OMNI25_TOKENS = ["<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>"] + AUDIO_TOKENS


def build_omni25(out: Path, seed: int = 0) -> str:
    """The whole model as Qwen2.5-Omni ships (thinker, talker, token2wav, spk_dict.pt)."""
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    tok = _tokenizer(OMNI25_TOKENS)
    start, end, image, video, audio_start, audio, audio_end = tok.convert_tokens_to_ids(
        OMNI25_TOKENS)
    ids = dict(audio_token_index=audio, image_token_index=image, video_token_index=video,
               vision_start_token_id=start, vision_end_token_id=end,
               audio_start_token_id=audio_start, audio_end_token_id=audio_end)
    # sectioned M-RoPE (Qwen2-VL's, not Qwen3's interleaving) over head_dim 8: t 1, h 1, w 2
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]}
    text = dict(vocab_size=len(tok) + len(tok) % 2, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rope_parameters=rope, tie_word_embeddings=False)
    thinker = dict(
        text_config=text,
        audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2,
                          encoder_ffn_dim=32, output_dim=32, num_mel_bins=MEL_BINS,
                          max_source_positions=AUDIO_SECONDS * 50, n_window=50),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=32, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0]),
        **ids)
    talker = dict(vocab_size=64, embedding_size=32, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rope_parameters=rope, tts_text_start_token_id=0, tts_text_end_token_id=1,
                  tts_text_pad_token_id=2, tts_codec_start_token_id=60,
                  tts_codec_end_token_id=61, tts_codec_pad_token_id=62,
                  tts_codec_mask_token_id=63, **ids)
    token2wav = dict(
        dit_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                        emb_dim=16, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48],
                        enc_attention_channels=8, enc_se_channels=8, num_embeds=65,
                        mel_dim=MEL_BINS, look_ahead_layers=[0], look_backward_layers=[0]),
        bigvgan_config=dict(mel_dim=MEL_BINS, upsample_initial_channel=16, upsample_rates=[2, 2],
                            upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3],
                            resblock_dilation_sizes=[[1, 3, 5]]))
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker,
                               token2wav_config=token2wav, enable_audio_output=True)
    line = _save(Qwen2_5OmniForConditionalGeneration, config, tok, out, seed)
    # the speakers transformers' from_pretrained always loads (used only to speak)
    torch.save({"Chelsie": {"cond": torch.zeros(1, 16), "ref_mel": torch.zeros(1, 30, MEL_BINS),
                            "bos_token": 60}}, out / "spk_dict.pt")
    _save_omni_preprocessor(out, patch_size=14, pixels=(MIN_PIXELS, MAX_PIXELS),
                            processor_class="Qwen2_5OmniProcessor", mean_std=None)
    _name_omni_tokens(out, OMNI25_TOKENS)
    return line


def build_multimodal(kind: str, out: Path, seed: int = 0) -> str:
    return {"vl": build_vl, "vl3": build_vl3, "vl3moe": build_vl3moe, "audio": build_audio,
            "omni3": build_omni3, "omni25": build_omni25}[kind](out, seed)
