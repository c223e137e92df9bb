"""The hf engine's model calls besides `generate`: a batch's media tensors as the model takes
them, and teacher-forced log-probs of input tokens (how a teacher scores a student).
"""

from __future__ import annotations

import torch

from relax_slurm.data.processor import concat_tensors
from relax_slurm.modeling import mm_token_types
from relax_slurm.engines.hf.batch import Row

# media tensors not cast to the model's dtype: the videos' seconds (data/processor.py)
_KEEP_DTYPE = frozenset({"second_per_grid_ts", "video_second_per_grid"})


def mm_kwargs(model, device: torch.device, rows: list[Row], input_ids: torch.Tensor
              ) -> dict[str, torch.Tensor]:
    """The batch's media tensors: each row's, concatenated in row order (the order of their
    pads in the flattened ids); pixels and features in the model's dtype (a video's seconds
    per frame pair stay float32, as in the trainer: they scale positions); and the token
    types M-RoPE models place media by (`relax_slurm.modeling.mm_token_types`)."""
    per_row = [r.mm for r in rows if r.mm]
    if not per_row:
        return {}
    dtype = next(model.parameters()).dtype
    media = {k: (t.to(dtype) if t.is_floating_point() and k not in _KEEP_DTYPE else t
                 ).to(device)
             for k, t in ((k, torch.from_numpy(v)) for k, v in concat_tensors(per_row).items())}
    return {**media, **mm_token_types(model, input_ids, media)}


@torch.no_grad()  # scores only: no autograd graph of the whole prefill
def input_logprobs(model, device: torch.device, pad_id: int, rows: list[Row],
                   max_batch_size: int) -> None:
    """Each row's `input_logprobs`: log-probs of its input tokens from logprob_start_len on,
    the first input token's being None; one teacher-forced forward per chunk of rows. At
    temperature 1 whatever the request's temperature, as SGLang computes them (its prefill
    path reads no sampling params): a teacher scores the same on both engines."""
    for lo in range(0, len(rows), max_batch_size):
        chunk = rows[lo:lo + max_batch_size]
        width = max(len(r.input_ids) for r in chunk)
        # right padding: real tokens keep positions 0..L-1 and never attend to the padding
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, row in enumerate(chunk):
            input_ids[i, :len(row.input_ids)] = torch.tensor(row.input_ids)
            attention_mask[i, :len(row.input_ids)] = 1
        input_ids = input_ids.to(device)
        logits = model(input_ids=input_ids, attention_mask=attention_mask.to(device),
                       use_cache=False,
                       **mm_kwargs(model, device, chunk, input_ids)).logits  # [B, L, V]
        for i, row in enumerate(chunk):
            n = len(row.input_ids)
            scores = logits[i, :n - 1].float()  # [L-1, V]
            targets = input_ids[i, 1:n][:, None]
            norm = torch.logsumexp(scores, -1)  # [L-1]
            lps = scores.gather(1, targets).squeeze(1) - norm
            row.input_logprobs = [None, *lps.tolist()][row.logprob_start_len:]
            if row.token_ids_logprob:
                ids = row.token_ids_logprob
                rows_lp = (scores[:, ids] - norm[:, None]).tolist()  # [L-1, K]
                row.input_token_ids_logprobs = [None, *[
                    [[lp, tok, None] for lp, tok in zip(pos, ids)] for pos in rows_lp
                ]][row.logprob_start_len:]
