"""debug.dump_rollouts: every trained sample as text, one jsonl file per step, for reading.

Written by the trainer's rank 0 from the batch it trains on, so a dump shows exactly what the
loss saw (after staleness drops and filtering), with the versions that produced it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

from relax_slurm.routing.segments import covered_positions

DUMP_DIR = "rollouts"
Decode = Callable[[list[int]], str]


def dump_rows(groups: Iterable[list], step: int, decode: Decode) -> list[dict[str, Any]]:
    """Pure: groups of Samples -> one dict per sample."""
    return [
        {"step": step, "prompt_id": s.prompt_id, "group_id": s.group_id,
         "prompt": decode(s.prompt_ids.tolist()), "response": decode(s.response_ids.tolist()),
         "reward": float(s.reward), "version": int(s.version), "version_min": int(s.version_min),
         "version_spans": [list(span) for span in s.version_spans],
         "finish_reason": s.finish_reason, "prompt_len": int(len(s.prompt_ids)),
         "response_len": int(len(s.response_ids)), "routed_positions": routed_positions(s)}
        for g in groups for s in g
    ]


def routed_positions(sample: Any) -> int | None:
    """How many of the sample's prompt + response - 1 positions carry the rollout's routing
    (MoE models; a multi-turn sample's trailing observation has none), None without routing."""
    if sample.routed_experts is None:
        return None
    return covered_positions(sample.routed_experts,
                             len(sample.prompt_ids) + len(sample.response_ids) - 1)


def dump_path(run_dir: Path, step: int) -> Path:
    return run_dir / DUMP_DIR / f"step_{step:06d}.jsonl"


def write_dump(run_dir: Path, step: int, groups: Iterable[list], decode: Decode) -> Path:
    path = dump_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    # rewritten, not appended: a resumed run trains this step again and dumps its new batch
    path.write_text("".join(json.dumps(r) + "\n" for r in dump_rows(groups, step, decode)))
    return path


def tokenizer_decode(model_path: str, trust_remote_code: bool) -> Decode:
    from relax_slurm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path, trust_remote_code)
    return lambda ids: tok.decode(ids, skip_special_tokens=False)
