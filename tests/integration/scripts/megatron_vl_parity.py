"""torchrun --nproc-per-node N megatron_vl_parity.py --model-dir D --tp T [--ep E] --out DIR

A tiny Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3-Omni thinker / Qwen2.5-Omni thinker /
Qwen2-Audio under trainer=megatron on gloo (relax_slurm/trainer/megatron/vl.py, vl_moe.py,
omni*.py, audio_*.py); rank 0 writes DIR/result.json with, against the transformers model on
two right-padded rows with images of different sizes (the Omni thinkers: also an audio in each
row and a video in one, `omni_inputs`; Qwen2-Audio: an audio of its own
length in each row, `audio_inputs`):
- the largest logit difference on the rows' tokens (MegatronModel.forward with the media,
  a video too: Qwen2.5-VL's placed and spaced in time by M-RoPE's second_per_grid_ts,
  Qwen3-VL's one run of pads per frame after the frame's timestamp text, as its processor
  writes them, with DeepStack features of images and video merged in sequence order),
- the largest vision-tower gradient difference of a fixed random linear function of the logits
  (the patch embedding and the first block's qkv), each with the reference's scale (Qwen3-Omni:
  the audio tower's too, its first convolution and first layer's query),
- for the MoE: the gradients of every expert this rank holds (fc1 = transformers' fused
  gate_up_proj[e], fc2 = down_proj[e]) and of the routers, after Megatron's gradient
  reduction (the ranks all see the same rows: at EP=2 an expert gets both ranks' copies of its
  tokens and the reduction divides by DP=2); and the export of the same model from a copy of
  the file in Qwen's released layout (fused experts transposed) against that copy,
- the exported weight names (the bridge's) and the names of the checkpoint file and of the
  transformers model's parameters, and whether the export equals the file bitwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from safetensors.torch import load_file

from script_result import each_layout, finish

from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.megatron import tower_split, vl
from relax_slurm.trainer.megatron.model import MegatronModel, init_model_parallel


def inputs(path: str):
    """Two right-padded rows with images of different sizes; the second row also has a video
    after its image."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    proc, tok = AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 255, (28, 56, 3), dtype=np.uint8))]
    out = proc(images=images, return_tensors="pt")
    pv, thw = out["pixel_values"], out["image_grid_thw"]
    n = (thw.prod(-1) // 4).tolist()  # tokens per image after the 2x2 merge
    S, E, I = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    txt = tok("ab cd", add_special_tokens=False)["input_ids"]
    rows = [txt + [S] + [I] * n[0] + [E] + txt, txt[:2] + [S] + [I] * n[1] + [E] + txt + txt]
    media = {"pixel_values": pv, "image_grid_thw": thw}
    if cfg.model_type == "qwen2_5_vl":
        media.update(video(cfg.vision_config))
        rows[1] += [S] + [cfg.video_token_id] * video_tokens(media) + [E] + txt
    else:  # Qwen3-VL: "<t seconds>" before each frame's pads (the processor's layout)
        clip = video(cfg.vision_config)
        del clip["second_per_grid_ts"]
        media.update(clip)
        t = int(clip["video_grid_thw"][0, 0])
        for i in range(t):
            stamp = tok(f"<{i}.5 seconds>", add_special_tokens=False)["input_ids"]
            rows[1] += stamp + [S] + [cfg.video_token_id] * (video_tokens(media) // t) + [E]
        rows[1] += txt
    T, pad = max(map(len, rows)), tok.pad_token_id or 0
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    return ids, mask, media


# mel frames: Qwen3-Omni one 100-frame chunk (13 tokens) and a partial one; Qwen2.5-Omni 32
# and 9 tokens
OMNI_AUDIO_FRAMES = (130, 37)


def omni_inputs(path: str):
    """Two right-padded rows for the tiny Qwen3-Omni or Qwen2.5-Omni thinker (no processor: ids
    and tensors laid out as the model's processor lays them): row 0 text, an image, text, an
    audio, text; row 1 an image, text, a video (one run of pads, spaced in time by its
    video_second_per_grid: 25 positions a second), an audio, text. Pixels and mel features
    random: both models take the same tensors. Qwen3-Omni's audio tokens come per 100-frame
    chunk, Qwen2.5-Omni's as Qwen2-Audio's from mel padded to its 2 s window."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    tok, whole = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    cfg = whole.thinker_config
    vision = cfg.vision_config
    g = torch.Generator().manual_seed(11)
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])
    clip = video(vision)
    clip["video_second_per_grid"] = clip.pop("second_per_grid_ts")  # the thinker's own name
    frames = torch.tensor(OMNI_AUDIO_FRAMES)
    if whole.model_type == "qwen2_5_omni":
        mel, feature_mask = padded_mel(frames, cfg.audio_config, g)
        n_audio = (((frames - 1) // 2 + 1 - 2) // 2 + 1).tolist()
    else:
        feature_mask = (torch.arange(int(frames.max()))[None] < frames[:, None]).long()
        mel = torch.randn(len(frames), cfg.audio_config.num_mel_bins, int(frames.max()),
                          generator=g) * feature_mask[:, None]  # zero past each audio's end
        n_audio = _get_feat_extract_output_lengths(frames, cfg.audio_config.n_window).tolist()
    media = {"pixel_values": torch.randn(int(grids.prod(-1).sum()), dim, generator=g),
             "image_grid_thw": grids, **clip, "input_features": mel,
             "feature_attention_mask": feature_mask}
    n_img = (grids.prod(-1) // 4).tolist()
    S, E, I, V = (cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id,
                  cfg.video_token_id)
    AS, A = cfg.audio_start_token_id, cfg.audio_token_id
    AE = tok.convert_tokens_to_ids("<|audio_eos|>")
    txt = tok("ab cd", add_special_tokens=False)["input_ids"]
    rows = [txt + [S] + [I] * n_img[0] + [E] + txt + [AS] + [A] * n_audio[0] + [AE] + txt,
            txt[:2] + [S] + [I] * n_img[1] + [E] + txt + [S] + [V] * video_tokens(clip) + [E]
            + [AS] + [A] * n_audio[1] + [AE] + txt]
    T, pad = max(map(len, rows)), tok.pad_token_id or 0
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    return ids, mask, media


AUDIO_FRAMES = (200, 130)  # mel frames of 200 (2 s, the encoder's window): 50 and 33 tokens


def audio_inputs(path: str):
    """Two right-padded rows for the tiny Qwen2-Audio, laid out as its processor lays them
    (each audio's <|AUDIO|> pads expanded to its token count between <|audio_bos|> and
    <|audio_eos|>): row 0 text, a whole 2 s audio, text; row 1 text, a shorter audio (the
    rest of its 200 frames padding, masked), text. Mel features random: both models take the
    same tensors."""
    from transformers import AutoConfig, AutoTokenizer

    tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    frames = torch.tensor(AUDIO_FRAMES)
    mel, feature_mask = padded_mel(frames, cfg.audio_config, torch.Generator().manual_seed(13))
    n = (((frames - 1) // 2 + 1 - 2) // 2 + 1).tolist()  # the encoder's conv and pooling
    AB, A, AE = tok.convert_tokens_to_ids(["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"])
    txt = tok("ab cd", add_special_tokens=False)["input_ids"]
    rows = [txt + [AB] + [A] * n[0] + [AE] + txt, txt[:2] + [AB] + [A] * n[1] + [AE] + txt + txt]
    T, pad = max(map(len, rows)), tok.pad_token_id or 0
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    return ids, mask, {"input_features": mel, "feature_attention_mask": feature_mask}


def padded_mel(frames, audio_config, g) -> tuple:
    """Random mel features [A, mel, window] of audios `frames` long, zero past each one's end
    (the window: the encoder's, max_source_positions x 2 frames), and their feature mask."""
    width = audio_config.max_source_positions * 2
    feature_mask = (torch.arange(width)[None] < frames[:, None]).long()
    mel = torch.randn(len(frames), audio_config.num_mel_bins, width,
                      generator=g) * feature_mask[:, None]
    return mel, feature_mask


def hf_kwargs(hf, ids, media: dict) -> dict:
    """The transformers model's media kwargs: VL models take `mm_token_type_ids` (1 image, 2
    video: their M-RoPE input); Qwen3-Omni's thinker and Qwen2-Audio the media alone."""
    if hf.config.model_type.startswith(("qwen3_omni", "qwen2_5_omni", "qwen2_audio")):
        return dict(media)
    return {"mm_token_type_ids": vl.token_types(hf.config, ids), **media}


def video(vision) -> dict:
    """A video as the processor lays it out: 4 frames of 56x56 -> (t, h, w) = (2, 4, 4)
    patches of channels x temporal_patch_size x patch_size^2 values, 0.5 s per temporal patch
    (random values: both models take the same tensors)."""
    t, h, w = 2, 4, 4
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    g = torch.Generator().manual_seed(7)
    return {"pixel_values_videos": torch.randn(t * h * w, dim, generator=g),
            "video_grid_thw": torch.tensor([[t, h, w]]),
            "second_per_grid_ts": torch.tensor([0.5])}


def video_tokens(media: dict) -> int:
    return int(media["video_grid_thw"].prod()) // 4  # after the 2x2 merge


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--towers", default="replicated")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    cfg = TrainerConfig(backend="megatron", tensor_parallel_size=args.tp,
                        expert_parallel_size=args.ep, lr=1e-2, micro_batch_size=2,
                        nproc_per_node=dist.get_world_size(), towers=args.towers)
    init_model_parallel(cfg)
    mm = MegatronModel(ModelConfig(path=args.model_dir), cfg)
    result: dict = {}

    hf_sd = load_file(str(Path(args.model_dir) / "model.safetensors"))
    exported = dict(mm.named_hf_weights())
    result["exported_names"] = sorted(exported)
    result["file_names"] = sorted(hf_sd)
    result["export_bitwise"] = all(torch.equal(exported[k], hf_sd[k]) for k in hf_sd
                                   if k in exported)

    from transformers import AutoModelForImageTextToText

    if mm.vl == vl.OMNI:  # the thinker: what trainer=megatron builds and trains
        from transformers import Qwen3OmniMoeForConditionalGeneration

        hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            args.model_dir, dtype=torch.float32).thinker
        ids, mask, media = omni_inputs(args.model_dir)
    elif mm.vl == vl.OMNI25:
        from transformers import Qwen2_5OmniForConditionalGeneration

        hf = Qwen2_5OmniForConditionalGeneration.from_pretrained(
            args.model_dir, dtype=torch.float32, enable_audio_output=False).thinker
        ids, mask, media = omni_inputs(args.model_dir)
    elif mm.vl == vl.AUDIO:
        from transformers import Qwen2AudioForConditionalGeneration

        hf = Qwen2AudioForConditionalGeneration.from_pretrained(args.model_dir,
                                                                dtype=torch.float32)
        ids, mask, media = audio_inputs(args.model_dir)
    else:
        hf = AutoModelForImageTextToText.from_pretrained(args.model_dir, dtype=torch.float32)
        ids, mask, media = inputs(args.model_dir)
    result["hf_param_names"] = sorted(n for n, _ in hf.named_parameters())
    hf_kw = hf_kwargs(hf, ids, media)
    chunk = mm.chunks[0]
    valid = mask.bool()

    hf.train()  # no dropout in these models: train() only enables the gradients' bookkeeping
    ref = hf(input_ids=ids, attention_mask=mask, **hf_kw).logits
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3)) * mask[..., None]
    (ref * w).sum().backward()
    mm.train()
    for c in mm.chunks:
        c.zero_grad_buffer()
    # (under sequence parallelism the rows are padded to a multiple of TP: cut back); with
    # trainer.towers=split, the cuts of each tower call's items over the TP ranks recorded
    cuts, blocks = [], tower_split.blocks
    tower_split.blocks = lambda rows, parts: cuts.append([list(rows), blocks(rows, parts)]) \
        or cuts[-1][1]
    try:
        ours = mm.full_logits(mm.forward(chunk, ids, attention_mask=mask, media=media))
    finally:
        tower_split.blocks = blocks
    result["tower_cuts"] = cuts
    ours = ours[:, :ids.shape[1]]
    (ours * w).sum().backward()
    chunk.config.finalize_model_grads_func(mm.chunks)  # DP/EP reduction, as a train step does
    result["logits_max_diff"] = (ours - ref).abs()[valid].max().item()
    result["logits_scale"] = ref.abs()[valid].max().item()

    params = dict(chunk.module.named_parameters())
    hf_params = dict(hf.named_parameters())
    if mm.vl == vl.AUDIO:  # the encoder's first convolution and query, the projector
        result["audio_grads"] = tower_grads(params, hf_params, (
            ("audio_tower.conv1.weight", "model.audio_tower.conv1.weight"),
            ("audio_tower.layers.0.self_attn.q_proj.weight",
             "model.audio_tower.layers.0.self_attn.q_proj.weight"),
            ("multi_modal_projector.linear.weight",
             "model.multi_modal_projector.linear.weight")))
    elif mm.vl == vl.OMNI25:  # q of its own in the vision blocks; the audio encoder's conv, query
        result["vision_grads"] = tower_grads(params, hf_params, (
            ("visual.patch_embed.proj.weight", "model.visual.patch_embed.proj.weight"),
            ("visual.blocks.0.attn.q.weight", "model.visual.blocks.0.attn.q.weight")))
        result["audio_grads"] = tower_grads(params, hf_params, (
            ("audio_tower.conv1.weight", "model.audio_tower.conv1.weight"),
            ("audio_tower.layers.0.self_attn.q_proj.weight",
             "model.audio_tower.layers.0.self_attn.q_proj.weight")))
    else:
        result["vision_grads"] = vision_grads(chunk.module, params, hf_params)
    if mm.vl == vl.OMNI:
        result["audio_grads"] = tower_grads(params, hf_params, (
            ("audio_model.conv2d1.weight", "model.audio_tower.conv2d1.weight"),
            ("audio_model.layers.0.self_attn.q_proj.weight",
             "model.audio_tower.layers.0.self_attn.q_proj.weight")))
    if hasattr(hf.config.text_config, "num_experts") and args.tp == 1:
        # (at TP > 1 each expert's matrices are split over TP: the EP rows compare them)
        result["moe_grads"] = moe_grads(params, hf_params, hf.config.text_config)
    if hasattr(hf.config.text_config, "num_experts"):
        # at TP > 1 under sequence parallelism: each rank's routers see its slice of the rows
        result["replay"] = replayed_logits(mm, hf, ids, mask, media, hf_kw, ours.detach())
    if mm.vl == vl.QWEN3_MOE:
        result["qwen_layout"] = qwen_layout_export(mm, args.model_dir, args.out, cfg)
    finish(args.out, result)


def vision_grads(inner, params: dict, hf_params: dict) -> dict:
    """The patch embedding's and the first block's qkv gradients against transformers'."""
    vision = "visual" if hasattr(inner, "visual") else "vision_model"
    return tower_grads(params, hf_params, ((f"{vision}.patch_embed.proj.weight",
                                            "model.visual.patch_embed.proj.weight"),
                                           (f"{vision}.blocks.0.attn.qkv.weight",
                                            "model.visual.blocks.0.attn.qkv.weight")))


def tower_grads(params: dict, hf_params: dict, pairs) -> dict:
    """(our name, transformers' name) of replicated tower parameters -> their gradients'
    largest difference, the reference's scale, and whether every rank holds the same."""
    grads = {}
    for ours_name, hf_name in pairs:
        p = params[ours_name]
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        ref_g = hf_params[hf_name].grad
        # the same on every TP rank: the tower is replicated and gets the same gradient
        gathered = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, g.contiguous())
        grads[hf_name] = {"max_diff": (g - ref_g).abs().max().item(),
                          "scale": ref_g.abs().max().item(),
                          "equal_across_ranks": all(torch.equal(gathered[0], x) for x in gathered)}
    return grads


def _grad(p):
    return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad


def moe_grads(params: dict, hf_params: dict, text) -> dict:
    """Every local expert's and every router's gradient against transformers' (per layer, the
    largest difference and the reference's scale; gathered to rank 0)."""
    from megatron.core import parallel_state as ps

    per_rank = text.num_experts // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * per_rank
    out = {}
    for layer in range(text.num_hidden_layers):
        ours = f"language_model.decoder.layers.{layer}.mlp"
        hf = f"model.language_model.layers.{layer}.mlp"
        pairs = [(_grad(params[f"{ours}.router.weight"]), hf_params[f"{hf}.gate.weight"].grad)]
        for n in range(per_rank):
            e = first + n
            pairs += [(_grad(params[f"{ours}.experts.local_experts.{n}.linear_fc{k}.weight"]),
                       hf_params[f"{hf}.experts.{name}"].grad[e])
                      for k, name in ((1, "gate_up_proj"), (2, "down_proj"))]
        out[str(layer)] = {"max_diff": max((a - b).abs().max().item() for a, b in pairs),
                           "scale": max(b.abs().max().item() for _, b in pairs)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return {f"rank{r}/layer{k}": v for r, g in enumerate(gathered) for k, v in g.items()}


def replayed_logits(mm, hf, ids, mask, media, hf_kw, unreplayed) -> dict:
    """Routing replay (algo.routing_replay) of random experts per token and layer, image tokens
    included, in both models: megatron's routers (trainer/megatron/routing.py, which assumes
    the language model sees the rows' tokens in order) against transformers' (routing/hooks.py);
    the largest logit difference, its scale, and how far replay moved the logits."""
    from relax_slurm.routing.hooks import RoutingStats, routing_replay
    from relax_slurm.trainer.megatron.routing import megatron_routing

    text = hf.config.text_config
    B, T = ids.shape
    L, E, K = text.num_hidden_layers, text.num_experts, text.num_experts_per_tok
    g = torch.Generator().manual_seed(5)
    routed = torch.rand(B, T, L, E, generator=g).argsort(-1)[..., :K].reshape(B, T, L * K)
    valid = mask.bool()
    stats = RoutingStats()
    with torch.no_grad():
        with routing_replay(hf, routed, valid, replay=True):
            ref = hf(input_ids=ids, attention_mask=mask, **hf_kw).logits
        with megatron_routing(mm.chunks, routed, valid, replay=True, stats=stats):
            ours = mm.full_logits(mm.forward(mm.chunks[0], ids, attention_mask=mask,
                                             media=media))[:, :ids.shape[1]]
    return {"max_diff": (ours - ref).abs()[valid].max().item(),
            "scale": ref.abs()[valid].max().item(),
            "moved": (ours - unreplayed).abs()[valid].max().item(),
            "mismatch_frac": stats.mismatched / stats.pairs}


def qwen_layout_export(mm, model_dir: str, out: Path, cfg) -> dict:
    """The same weights in a file with Qwen's released layout of the fused experts
    (gate_up_proj [E, H, 2I], down_proj [E, I, H]): loaded, the model's export equals the
    first model's, and its export is that file bit for bit."""
    import shutil

    from safetensors.torch import save_file

    copy = out / "qwen_layout"
    if dist.get_rank() == 0:
        shutil.copytree(model_dir, copy, dirs_exist_ok=True)
        sd = load_file(str(Path(model_dir) / "model.safetensors"))
        sd = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v
              for k, v in sd.items()}
        save_file(sd, str(copy / "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    first = dict(mm.named_hf_weights())
    other = dict(MegatronModel(ModelConfig(path=str(copy)), cfg).named_hf_weights())
    file = load_file(str(copy / "model.safetensors"))
    return {"names_equal": sorted(other) == sorted(file),
            "export_bitwise": all(torch.equal(other[k], file[k]) for k in file if k in other),
            "same_weights": all(torch.equal(other[k], first[k].transpose(1, 2))
                                if ".mlp.experts." in k else torch.equal(other[k], first[k])
                                for k in first)}


if __name__ == "__main__":
    each_layout(main)
