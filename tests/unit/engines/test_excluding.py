"""A teacher's log-probs without the student's media pads (engines/client.py `excluding`): the
engine's log-probs over the whole vocabulary, renormalized from the pads' own log-probs."""

from __future__ import annotations

import math

import pytest

from relax_slurm.engines.client import excluding
from relax_slurm.errors import EngineError


def test_log_probs_are_renormalized_without_the_excluded_ids():
    half, quarter = math.log(0.5), math.log(0.25)
    ids_logprobs = [None, [[half, 3, None]], [[quarter, 3, None], [quarter, 4, None]]]
    out = excluding([-1.0, -2.0], ids_logprobs, "http://e")
    # p / (1 - 0.5) at both positions: + log 2
    assert out == pytest.approx([-1.0 + math.log(2), -2.0 + math.log(2)], abs=1e-12)
    # nothing excluded has any mass: unchanged
    assert excluding([-1.0], [None, [[-math.inf, 3, None]]], "http://e") == [-1.0]


def test_an_engine_that_did_not_return_them_is_an_error():
    with pytest.raises(EngineError, match=r"http://e/generate: no input_token_ids_logprobs"):
        excluding([-1.0, -2.0], None, "http://e")
    with pytest.raises(EngineError, match="input_token_ids_logprobs"):
        excluding([-1.0, -2.0], [None, [[-1.0, 3, None]]], "http://e")
