"""debug.dump_rollouts: per-step jsonl of what was trained on."""

from __future__ import annotations

import json

import numpy as np

from relax_slurm.metrics.rollout_dump import dump_path, write_dump
from relax_slurm.samples import Sample


def sample(gid: int, reward: float, version: int) -> Sample:
    return Sample(prompt_id=f"p{gid}", group_id=gid, prompt_ids=np.array([1, 2]),
                  response_ids=np.array([3, 4, 5]), loss_mask=np.ones(3),
                  rollout_logprobs=np.zeros(3), reward=reward, version=version,
                  version_min=version - 1, finish_reason="length",
                  version_spans=[[version - 1, 0, 1], [version, 1, 3]])


def test_one_line_per_sample_with_text_reward_and_versions(tmp_path):
    groups = [[sample(0, 1.0, 3), sample(0, 0.0, 3)], [sample(1, 0.5, 2)]]
    decode = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    path = write_dump(tmp_path, 7, groups, decode)
    assert path == dump_path(tmp_path, 7) == tmp_path / "rollouts" / "step_000007.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 0.5]
    assert rows[2] == {"step": 7, "prompt_id": "p1", "group_id": 1, "prompt": "t1 t2",
                       "response": "t3 t4 t5", "reward": 0.5, "version": 2, "version_min": 1,
                       "version_spans": [[1, 0, 1], [2, 1, 3]], "finish_reason": "length",
                       "prompt_len": 2, "response_len": 3, "routed_positions": None}
    write_dump(tmp_path, 7, groups[:1], decode)  # a resumed run trains step 7 again
    assert len(path.read_text().splitlines()) == 2
