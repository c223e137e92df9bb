"""`ifbench`: IFBench's instruction ids, all-or-nothing, as Relax scores them.

Relax's `ifbench` runs IFBench's own strict test (allenai/IFBench, `evaluation_lib.
test_instruction_following_strict`) on the whole response: 1.0 when it follows every
instruction of `metadata.instruction_id_list` with `metadata.kwargs`, else 0.0. As there:
- `kwargs` is a list with one dict per instruction (a shorter list is padded with its last
  dict, a longer one cut; one dict is used for every instruction) and `None` values are dropped;
- an empty (or blank) response follows nothing;
- the whole response is checked, reasoning included (unlike `ifeval`, which reads the text
  after `</think>`).

IFBench registers 83 ids: the 25 of IFEval and 58 of its own. Their checks are in
`ifbench_classic` (IFEval's), `ifbench_checks` (IFBench's own) and `ifbench_nlp` (22 of either
kind whose checker needs NLTK, langdetect, syllapy or emoji: the `ifbench` extra; NLTK's trained
sentence splitter is replaced by untrained Punkt there). The one id whose checker needs trained
data with no stand-in (NLTK's POS tagger) is in `UNSUPPORTED` with what it needs. A row with
such an id, an id IFBench does not have, or without `instruction_id_list` raises (a reward
error scored 0), so that no row is graded on part of its instructions.
"""

from __future__ import annotations

from typing import Any

from relax_slurm.rewards.ifbench_checks import OOD, Check
from relax_slurm.rewards.ifbench_classic import CLASSIC
from relax_slurm.rewards.ifbench_nlp import NLP
from relax_slurm.rewards.registry import RewardInput, register

# The one checker with no stand-in here: NLTK's POS tagger is trained data only (NLTK's data
# cannot be downloaded at run time); the rest of NLTK's users are in `ifbench_nlp`.
UNSUPPORTED: dict[str, str] = {
    "words:start_verb": "NLTK's POS tagger (trained data)",
}
CHECKS: dict[str, Check] = {**CLASSIC, **OOD, **NLP}
IFBENCH_IDS = frozenset(CHECKS) | frozenset(UNSUPPORTED)


def instruction_kwargs(raw: Any, n: int) -> list[dict[str, Any]]:
    """One kwargs dict per instruction, as Relax builds them for IFBench.

    >>> instruction_kwargs([{"N": 3, "x": None}], 2)
    [{'N': 3}, {'N': 3}]
    >>> instruction_kwargs({"N": 1}, 2), instruction_kwargs(None, 1)
    ([{'N': 1}, {'N': 1}], [{}])
    """
    if isinstance(raw, list):
        dicts = [dict(d) if isinstance(d, dict) else {} for d in raw]
    elif isinstance(raw, dict):
        dicts = [dict(raw) for _ in range(n)]
    else:
        dicts = [{} for _ in range(n)]
    dicts = dicts[:n] + [dict(dicts[-1] if dicts else {}) for _ in range(n - len(dicts))]
    return [{k: v for k, v in d.items() if v is not None} for d in dicts]


def check(instruction_id: str, response: str, kwargs: dict[str, Any]) -> bool:
    """Whether `response` follows one IFBench instruction (IFBench's strict test)."""
    fn = CHECKS.get(instruction_id)
    if fn is None:
        if instruction_id in UNSUPPORTED:
            raise ValueError(f"ifbench: instruction {instruction_id!r} is not implemented here: "
                             f"IFBench's checker needs {UNSUPPORTED[instruction_id]}")
        raise ValueError(f"ifbench: {instruction_id!r} is not an IFBench instruction id; "
                         f"IFBench has {sorted(IFBENCH_IDS)}")
    try:
        return bool(response.strip()) and bool(fn(response, **kwargs))
    except TypeError as e:
        raise ValueError(f"ifbench: instruction {instruction_id!r} with kwargs {kwargs}: "
                         f"{e}") from e


@register("ifbench")
def ifbench_reward(inp: RewardInput) -> float:
    """1.0 when the response follows every instruction of the row, else 0.0.

    >>> meta = {"instruction_id_list": ["punctuation:no_comma", "count:numbers"],
    ...         "kwargs": [{}, {"N": 2}]}
    >>> ifbench_reward(RewardInput(prompt="", response="Take 3 then 4.", label=None,
    ...     metadata=meta))
    1.0
    >>> ifbench_reward(RewardInput(prompt="", response="Take 3, then 4.", label=None,
    ...     metadata=meta))
    0.0
    """
    metadata = inp.metadata or {}
    ids = [str(i).strip() for i in metadata.get("instruction_id_list") or []
           if i is not None and str(i).strip()]
    if not ids:
        raise ValueError("ifbench needs metadata.instruction_id_list (and metadata.kwargs); "
                         "set data.metadata_key to the column holding them")
    kwargs = instruction_kwargs(metadata.get("kwargs"), len(ids))
    followed = [check(i, inp.response, k) for i, k in zip(ids, kwargs)]
    return 1.0 if all(followed) else 0.0
