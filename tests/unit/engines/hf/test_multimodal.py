"""The hf engine's multimodal /generate (SGLang's image_data / video_data / audio_data) against
the trainer: the same expanded tokens, and the trainer's log-probs at the rollout weights equal
the engine's."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from helpers_tiny import free_port, start_engine, stop_process, wait_healthy
from relax_slurm.config.algo import AlgoConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.data import PromptDataset
from relax_slurm.data.processor import MediaProcessor
from relax_slurm.errors import EngineError
from relax_slurm.engines.client import EngineClient
from relax_slurm.samples import Sample
from relax_slurm.trainer.batch import collate, prepare_items
from relax_slurm.trainer.model import freeze_modules, load_hf_model, pad_token_id
from relax_slurm.trainer.step import token_logprobs

pytestmark = pytest.mark.slow  # five real engines (~55 s of start-up), as test_hf_engine_http

# kind -> (model, task, media kind, column, the tower that gets gradients)
KINDS = {"vl": ("vl_model", "colors", "image", "images", "model.visual"),
         "video": ("vl_model", "change", "video", "videos", "model.visual"),
         "vl3": ("vl3_model", "colors", "image", "images", "model.visual"),  # Qwen3-VL
         "vl3_video": ("vl3_model", "change", "video", "videos", "model.visual"),  # timestamped
         "audio": ("audio_model", "tones", "audio", "audios", "model.audio_tower")}


@pytest.fixture(scope="module", params=list(KINDS))
def served(request, tiny_mm_assets: Path, tmp_path_factory):
    kind = request.param
    model = tiny_mm_assets / KINDS[kind][0]
    port, log = free_port(), tmp_path_factory.mktemp("eng") / "engine.log"
    proc = start_engine(model, port, log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 300, log)
        yield kind, model, EngineClient(f"http://127.0.0.1:{port}", timeout_s=120)
    finally:
        stop_process(proc)


def prompts(tiny_mm_assets: Path, kind: str, model: Path) -> PromptDataset:
    _, task, key, col, _ = KINDS[kind]
    cfg = DataConfig(train_files=[str(tiny_mm_assets / f"{task}_test.jsonl")],
                     multimodal_keys={key: col}, shuffle=False)
    return PromptDataset(cfg, AutoTokenizer.from_pretrained(model))


def test_engine_and_trainer_see_the_same_tokens(served, tiny_mm_assets: Path) -> None:
    kind, model, client = served
    ds = prompts(tiny_mm_assets, kind, model)
    mp = MediaProcessor(model, AutoTokenizer.from_pretrained(model).get_vocab())
    rows = [ds[0], ds[1]]
    # prompts of two lengths: left padding in the engine's batch, right padding in the trainer's
    # (M-RoPE positions of media tokens must come out the same from both)
    prefix = AutoTokenizer.from_pretrained(model)("12+")["input_ids"]
    unexpanded = [list(rows[0].input_ids), prefix + list(rows[1].input_ids)]
    processed = [mp.process(ids, p.media) for ids, p in zip(unexpanded, rows)]
    media = [{k: [r.to_engine() for r in refs] for k, refs in p.media.items()} for p in rows]
    n = 2  # samples per prompt
    params = [{"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 7 + i} for i in range(4)]
    results = client.generate([pr.input_ids for pr in processed for _ in range(n)], params,
                              media=[m for m in media for _ in range(n)])
    for res, pr in zip(results, [pr for pr in processed for _ in range(n)]):
        assert res.meta_info["prompt_tokens"] == len(pr.input_ids)  # the same expanded ids
    # unexpanded ids (one pad per item) and base64 items give the same tokens
    inline = [{k: [base64.b64encode(Path(v).read_bytes()).decode() for v in vs]
               for k, vs in m.items()} for m in media]
    again = client.generate([ids for ids in unexpanded for _ in range(n)], params,
                            media=[m for m in inline for _ in range(n)])
    assert [r.output_ids for r in again] == [r.output_ids for r in results]
    assert [r.logprobs for r in again] == [r.logprobs for r in results]

    # the trainer: samples carrying the worker's tensors, collated, one forward
    samples = [Sample(prompt_id=str(i // n), group_id=i // n,
                      prompt_ids=processed[i // n].input_ids, response_ids=r.output_ids,
                      loss_mask=[1.0] * len(r.output_ids), rollout_logprobs=r.logprobs,
                      mm_inputs=processed[i // n].tensors, reward=float(i % 2))
               for i, r in enumerate(results)]
    groups = [samples[:n], samples[n:]]
    trainer_model = load_hf_model(ModelConfig(path=str(model)), torch.device("cpu"))
    mb = collate(prepare_items(groups, AlgoConfig()), pad_token_id(trainer_model.config),
                 torch.device("cpu"))
    with torch.no_grad():
        logp = token_logprobs(trainer_model, mb, 1.0)  # [B, T-1]
    mask = mb.weights > 0
    np.testing.assert_allclose(logp[mask].numpy(), mb.rollout_logp[mask].numpy(), atol=2e-4)
    if kind == "vl3":  # M-RoPE is on: a 2x2-token image spans 2 positions, not 4
        assert (trainer_model.model.rope_deltas == -2).all(), trainer_model.model.rope_deltas
    # the media do reach the forward: other pixels / features give other log-probs
    media = mb.media.tensors
    shifted = {k: v + 1.0 if v.is_floating_point() and k != "second_per_grid_ts" else v
               for k, v in media.items()}
    mb.media.tensors = shifted
    with torch.no_grad():
        other = token_logprobs(trainer_model, mb, 1.0)
    mb.media.tensors = media
    assert not torch.allclose(other[mask], logp[mask], atol=1e-4)
    if kind == "video":  # M-RoPE is on: a clip's time spacing moves its tokens' positions
        mb.media.tensors = {**media, "second_per_grid_ts": media["second_per_grid_ts"] * 4}
        with torch.no_grad():
            other = token_logprobs(trainer_model, mb, 1.0)
        mb.media.tensors = media
        assert not torch.allclose(other[mask], logp[mask], atol=1e-4)
    # micro-batches cut the media with their rows
    with torch.no_grad():
        half = token_logprobs(trainer_model, mb.rows(2, 4), 1.0)
    np.testing.assert_allclose(half[mb.rows(2, 4).weights > 0].numpy(),
                               logp[2:4][mb.weights[2:4, :half.shape[1]] > 0].numpy(), atol=1e-5)
    # gradients reach the tower unless it is frozen
    tower = KINDS[kind][4]
    trainer_model.train()
    (token_logprobs(trainer_model, mb, 1.0)[mask].sum()).backward()
    grads = [p.grad for n_, p in trainer_model.named_parameters() if n_.startswith(tower)]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert freeze_modules(trainer_model, [tower]) > 0
    assert not any(p.requires_grad for n_, p in trainer_model.named_parameters()
                   if n_.startswith(tower))


def test_bad_media_requests(served, tiny_mm_assets: Path) -> None:
    kind, model, client = served
    ds = prompts(tiny_mm_assets, kind, model)
    key = KINDS[kind][2]
    item = ds[0].media[key][0].to_engine()
    text_ids = AutoTokenizer.from_pretrained(model)("1=")["input_ids"]
    with pytest.raises(EngineError, match="0 pad runs in the ids but 1 media items"):
        client.generate([text_ids], {"max_new_tokens": 1}, media=[{key: [item]}])
    with pytest.raises(EngineError, match="neither an existing file nor base64"):
        client.generate([ds[0].input_ids], {"max_new_tokens": 1},
                        media=[{key: ["/no/such/file"]}])


def test_evaluator_sends_the_media(served, tiny_mm_assets: Path) -> None:
    from relax_slurm.config.evaluation import EvalConfig
    from relax_slurm.config.schema import TrainConfig
    from relax_slurm.evaluate import Evaluator

    kind, model, client = served
    _, task, key, col, _ = KINDS[kind]
    path = str(tiny_mm_assets / f"{task}_test.jsonl")
    cfg = TrainConfig(model=ModelConfig(path=str(model)),
                      data=DataConfig(train_files=[path], multimodal_keys={key: col}),
                      eval=EvalConfig(every=1, datasets=[path], n_samples=2, temperature=0.6,
                                     max_prompts=3))
    ev = Evaluator(cfg, [client.url])
    try:
        out = ev.run()
    finally:
        ev.close()
    assert 0.0 <= out[f"eval/{task}_test/mean@2"] <= 1.0


def test_media_pad_tokens_are_never_sampled(served, tiny_mm_assets: Path) -> None:
    """A sampled pad would be read as a media slot by the trainer's forward: the engine bans
    them (and the trainer leaves them out of its softmax, so log-probs still agree)."""
    from transformers import AutoConfig

    from relax_slurm.modeling import media_token_ids

    kind, model, client = served
    banned = set(media_token_ids(AutoConfig.from_pretrained(model)))
    assert banned
    ids = AutoTokenizer.from_pretrained(model)("1=")["input_ids"]
    params = [{"max_new_tokens": 8, "temperature": 20.0, "ignore_eos": True, "sampling_seed": i}
              for i in range(32)]  # near-uniform draws: 256 tokens over a 22-token vocabulary
    results = client.generate([ids] * 32, params)
    assert not banned & {t for r in results for t in r.output_ids}
