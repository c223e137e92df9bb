"""The sample format shared by rollout, broker and trainer.

Arrays are numpy (the broker imports no torch). One `Sample` is one response to one prompt; a
`Group` is the `n_samples_per_prompt` responses to one prompt, the unit the broker admits,
stores, drops and hands out (GRPO-family advantages are computed per group).

The loss mask and the multimodal slot are here from the start: multi-turn rollouts set the
mask to 0 on observation tokens, omni-modal rollouts put references to processed inputs in
`multimodal`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import numpy as np

# Fields that travel as raw buffers (zero-copy frames on the wire), with their dtypes.
ARRAY_FIELDS: dict[str, np.dtype] = {
    "prompt_ids": np.dtype(np.int64),
    "response_ids": np.dtype(np.int64),
    "loss_mask": np.dtype(np.float32),
    "rollout_logprobs": np.dtype(np.float32),
}
# Arrays a sample may lack (None): sent only when set, so messages without them stay valid.
OPTIONAL_ARRAY_FIELDS: dict[str, np.dtype] = {
    "teacher_logprobs": np.dtype(np.float32),
    "routed_experts": np.dtype(np.int16),
}


@dataclass(kw_only=True)
class Sample:
    """One response to one prompt, with everything the trainer needs."""

    prompt_id: str
    """Stable id of the prompt (dataset position or the row's own id)."""
    group_id: int
    """Id of the group this sample belongs to, unique within a run."""
    prompt_ids: np.ndarray
    """Prompt token ids after the chat template, [P] int64."""
    response_ids: np.ndarray
    """Generated token ids (and, in multi-turn, observation tokens), [R] int64."""
    loss_mask: np.ndarray
    """1.0 on tokens the policy produced and is trained on, 0.0 elsewhere, [R] float32."""
    rollout_logprobs: np.ndarray
    """Log-probs of `response_ids` under the engine that sampled them, [R] float32."""
    reward: float = 0.0
    version: int = 0
    """Newest weight version whose weights sampled a token of this sample."""
    version_min: int = 0
    """Oldest weight version that touched this sample (differs if weights changed mid-way):
    what the staleness rule and the drop rule judge."""
    version_spans: list[list[int]] = field(default_factory=list)
    """[version, start, end] runs of `response_ids` (end exclusive, in token order): the
    weights that sampled each generated token. One run unless a weight sync came while the
    sequence was generated (a retract, or an abort resumed from the prefix); tokens the policy
    did not sample (multi-turn observations) lie in no run. Empty: not recorded."""
    finish_reason: str = "stop"
    """'stop' (EOS or stop string), 'length' (hit max tokens) or 'abort'."""
    multimodal: dict[str, Any] = field(default_factory=dict)
    """References to multimodal inputs (msgpack-able); empty for text."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """What the rollout worker stamps (its rank, the data position, counts, times, a multi-turn
    episode's turns): a msgpack map of `SampleMeta`'s keys (relax_slurm/sample_meta.py), which
    builds and reads it; empty on a sample no worker produced."""
    teacher_logprobs: np.ndarray | None = None
    """Log-probs of `response_ids` under the teacher engine (on-policy distillation), [R]
    float32, or None without a teacher."""
    routed_experts: np.ndarray | None = None
    """MoE models: the expert ids the engine routed each token to, [(P + R - 1) x layers x
    top-k] int16 flattened (relax_slurm.routing.shape), or None. A position whose row is all -1
    (NOT_ROUTED: a multi-turn sample's position no turn's report covered,
    relax_slurm.routing.segments) is neither compared nor replayed."""
    mm_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """Processed media of the prompt, as the model's forward takes them (pixel_values [N, D],
    image_grid_thw [n, 3], input_features [n, mel, frames], ...); `prompt_ids` holds the
    expanded pads. N-D arrays, sent as raw frames (samples of a group share one)."""

    def __post_init__(self) -> None:
        for name, dtype in ARRAY_FIELDS.items():
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        for name, dtype in OPTIONAL_ARRAY_FIELDS.items():
            if getattr(self, name) is not None:
                setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        n = len(self.response_ids)
        where = f"sample {self.prompt_id}/{self.group_id}"
        check_lengths(where, n, len(self.loss_mask), len(self.rollout_logprobs),
                      None if self.teacher_logprobs is None else len(self.teacher_logprobs))
        self.version_spans = check_spans(self.version_spans, n, self.version_min, self.version,
                                         where)

    @property
    def response_len(self) -> int:
        return int(len(self.response_ids))

    @property
    def multi_version(self) -> bool:
        """Whether the weights changed while this sample was generated (its tokens come from
        more than one policy version)."""
        if self.version_spans:
            return len({v for v, _, _ in self.version_spans}) > 1
        return self.version != self.version_min


def samples_of_columns(columns: dict[str, Sequence[Any]]) -> list[Sample]:
    """The samples of a group given as columns (one sequence per field; a field left out takes
    its default), made without the constructor's per-sample work, for a caller that has
    already done it on the columns: `check_columns` passed, `version_spans` is the list it
    returned, and every array is contiguous and of its field's dtype (the wire's views of
    frames it decoded as those dtypes), so the constructor's casts would return each array as
    it is. The trainer's decode of a tiny step's 512 samples: 2.8 -> 2.1 ms
    (docs/benchmarks.md)."""
    every = fields(Sample)
    if unknown := columns.keys() - {f.name for f in every}:
        raise TypeError(f"samples_of_columns: {sorted(unknown)} name no Sample field")
    left = [f for f in every if f.name not in columns]
    required = [f.name for f in left if f.default is MISSING and f.default_factory is MISSING]
    if required:
        raise TypeError(f"samples_of_columns: fields {required} are required")
    defaults = {f.name: f.default for f in left if f.default is not MISSING}
    factories = [(f.name, f.default_factory) for f in left if f.default_factory is not MISSING]
    names = tuple(columns)
    out = []
    for row in zip(*columns.values()):
        sample = object.__new__(Sample)
        state = sample.__dict__
        state.update(defaults)
        state.update(zip(names, row))
        for name, factory in factories:
            state[name] = factory()
        out.append(sample)
    return out


def check_lengths(where: str, n: int, loss_mask: int, rollout_logprobs: int,
                  teacher_logprobs: int | None) -> None:
    """ValueError unless a sample's per-token arrays all have its `n` response tokens."""
    if loss_mask != n or rollout_logprobs != n:
        raise ValueError(f"{where}: response_ids has {n} tokens but loss_mask has {loss_mask} "
                         f"and rollout_logprobs {rollout_logprobs}; all three must match")
    if teacher_logprobs is not None and teacher_logprobs != n:
        raise ValueError(f"{where}: response_ids has {n} tokens but teacher_logprobs has "
                         f"{teacher_logprobs}; they must match")


def check_columns(scalars: dict[str, list], lengths: dict[str, list[int]]
                  ) -> list[list[list[int]]]:
    """`Sample.__post_init__`'s checks of a whole group given as columns, without making its
    samples (the broker's pass-through and the trainer's decode, broker/wire.py): `scalars`
    holds a list per scalar field (prompt_id, group_id, version, version_min, version_spans),
    `lengths` the per-sample lengths of each array field the group carries. Raises the
    ValueError the first bad sample's constructor would; returns each sample's version_spans
    as its constructor would hold them (fresh [version, start, end] int lists). The same
    functions check both ways, so the two cannot drift apart (tests/unit/broker/test_wire.py
    feeds every malformed group to both)."""
    def where(i: int) -> str:
        return f"sample {scalars['prompt_id'][i]}/{scalars['group_id'][i]}"
    n = lengths["response_ids"]
    others = [lengths.get(k) or [None] * len(n)
              for k in ("loss_mask", "rollout_logprobs", "teacher_logprobs")]
    # list equality, one C loop; else each sample's lengths, in the constructor's order
    lengths_ok = all(col == n for col in others[:2]) and others[2] in (n, [None] * len(n))
    out = []
    for i, spans in enumerate(scalars["version_spans"]):
        if not lengths_ok:
            check_lengths(where(i), n[i], *(col[i] for col in others))
        if not spans:  # (most groups record none, or one run per sample)
            out.append([])
            continue
        bounds = n[i], scalars["version_min"][i], scalars["version"][i]
        try:
            out.append(check_spans(spans, *bounds, ""))
        except ValueError:  # the same refusal again, named (no name made per sample)
            check_spans(spans, *bounds, where(i))
    return out


def check_spans(spans: Any, n: int, version_min: int, version: int, where: str
                ) -> list[list[int]]:
    """`spans` as plain [version, start, end] int lists (msgpack-able), or ValueError: ordered,
    non-empty, non-overlapping runs within the `n` response tokens whose versions lie in
    [version_min, version].

    >>> check_spans([(3, 0, 5), (4, 5, 9)], 9, 3, 4, "s")
    [[3, 0, 5], [4, 5, 9]]
    """
    out: list[list[int]] = []
    end = 0
    for span in spans:
        try:
            v, a, b = map(int, span)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: version_spans must be [version, start, end] integer "
                             f"triples, got {span!r}") from e
        if not (end <= a < b <= n):
            raise ValueError(f"{where}: version_spans {list(spans)!r} must be ordered, "
                             f"non-empty, non-overlapping runs within its {n} response tokens")
        if not version_min <= v <= version:
            raise ValueError(f"{where}: version_spans name version {v}, outside version_min="
                             f"{version_min} .. version={version}")
        out.append([v, a, b])
        end = b
    return out


Group = list[Sample]


def scalar_rows(group: Any) -> Sequence[Any]:
    """What the broker reads of a group's samples, their scalar fields (version_min, metadata,
    ids): a group it decoded (`broker.wire.Packed`, which never makes its samples) as light
    rows, any other group as its samples."""
    rows = getattr(group, "rows", None)
    return rows() if rows is not None else group


def group_version_min(group: Any) -> int:
    """The oldest weight version that touched any sample of the group."""
    return min(s.version_min for s in scalar_rows(group))
