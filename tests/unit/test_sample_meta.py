"""The typed contract of a sample's metadata (relax_slurm/sample_meta.py): what the rollout
worker writes is what the broker and the trainer read, through one dataclass."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.wire import SCALAR_FIELDS, decode, encode
from relax_slurm.errors import BrokerError
from relax_slurm.sample_meta import MetadataError, SampleMeta, metas_of
from relax_slurm.samples import ARRAY_FIELDS, OPTIONAL_ARRAY_FIELDS, Sample


def sample(metadata: dict) -> Sample:
    return Sample(prompt_id="p", group_id=3, prompt_ids=[1, 2], response_ids=[3],
                  loss_mask=[1.0], rollout_logprobs=[-0.5], metadata=metadata)


def test_round_trip_through_the_wire() -> None:
    meta = SampleMeta(worker=1, data_state={"epoch": 0, "index": 7, "seed": 1, "num_rows": 9},
                      reward_errors=2, filtered_groups=1, t_start=10.0, t_end=12.5,
                      t_scored=13.0, turns=3,
                      episode_end="max_turns", agent_group="g7")
    _, _, [[got]] = decode(encode("put_group", {}, [[sample(meta.to_dict())]]))
    assert SampleMeta.of(got) == meta


def test_unset_optional_keys_stay_off_the_wire_but_data_state_does_not() -> None:
    # the agent proxy's samples have no data position (None), which still marks one
    assert SampleMeta(worker=0).to_dict() == {"worker": 0, "data_state": None,
                                              "reward_errors": 0, "filtered_groups": 0}


def test_metadata_written_before_the_contract_still_reads() -> None:
    """What workers wrote before SampleMeta existed (spill files, queued groups): same keys."""
    old = {"t_start": 1.0, "t_end": 2.0, "worker": 0, "data_state": {"index": 4},
           "reward_errors": 0, "filtered_groups": 0}
    assert SampleMeta.from_dict(old).data_state == {"index": 4}
    episode = {"turns": 2, "episode_end": "done", **old, "data_state": None, "agent_group": "a"}
    assert SampleMeta.from_dict(episode).turns == 2


def test_an_unknown_key_is_named() -> None:
    with pytest.raises(MetadataError, match=r"unknown key\(s\) \['data_sate'\]"):
        SampleMeta.from_dict({"worker": 0, "data_sate": {}})
    with pytest.raises(TypeError, match="data_sate"):
        SampleMeta(worker=0, data_sate={})  # type: ignore[call-arg]


def test_a_missing_key_is_named() -> None:
    with pytest.raises(MetadataError, match=r"missing key\(s\) \['worker'\]"):
        SampleMeta.from_dict({"data_state": None})


def test_a_wrong_type_is_named() -> None:
    with pytest.raises(MetadataError, match="'worker' must be int, got True"):
        SampleMeta.from_dict({"worker": True})
    with pytest.raises(MetadataError, match="'turns' must be int or None"):
        SampleMeta(worker=0, turns="3")  # type: ignore[arg-type]


def test_empty_metadata_is_no_workers() -> None:
    assert SampleMeta.of(sample({})) is None


def test_the_broker_refuses_a_group_breaking_the_contract_and_changes_nothing() -> None:
    state = BrokerState(max_staleness=0, batch_size=2)
    assert state.admit(1) == 1
    with pytest.raises(BrokerError, match="sample p/3 metadata: unknown key"):
        state.accept([sample({"worker": 0, "wrker": 1})])
    with pytest.raises(BrokerError, match=r"missing key\(s\) \['worker'\]"):  # any sample
        state.accept([sample({"worker": 0}), sample({"data_state": None})])
    assert state.in_flight == 1 and state.accepted == 0 and not state.positions


def test_the_wire_carries_every_field_of_a_sample() -> None:
    """The wire's field list and Sample's fields are one set (a field misspelt or added on one
    side only would fail here, not at run time)."""
    names = {f.name for f in fields(Sample)}
    wired = {*SCALAR_FIELDS, *ARRAY_FIELDS, *OPTIONAL_ARRAY_FIELDS, "mm_inputs"}
    assert names == wired
    assert np.dtype(ARRAY_FIELDS["loss_mask"]) == np.float32


def test_metas_of_parses_each_run_of_equal_maps_once_and_still_names_a_bad_one() -> None:
    stamp = SampleMeta(worker=1, data_state={"epoch": 0}, t_start=1.0, t_end=2.0).to_dict()
    other = SampleMeta(worker=2).to_dict()
    group = [sample(dict(stamp)) for _ in range(3)] + [sample(other), sample({})]
    metas = metas_of(group)
    assert metas[0] is metas[1] is metas[2] and metas[0] == SampleMeta.of(group[0])
    assert metas[3] == SampleMeta(worker=2) and metas[4] is None
    with pytest.raises(MetadataError, match="'wroker'"):
        metas_of(group[:2] + [sample({**stamp, "wroker": 1})])
