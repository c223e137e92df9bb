"""`ifbench`: IFBench's instruction ids, all-or-nothing, as Relax scores them.

Relax's `ifbench` runs IFBench's own strict test (allenai/IFBench, `evaluation_lib.
test_instruction_following_strict`) on the whole response: 1.0 when it follows every
instruction of `metadata.instruction_id_list` with `metadata.kwargs`, else 0.0. As there:
- `kwargs` is a list with one dict per instruction (a shorter list is padded with its last
  dict, a longer one cut; one dict is used for every instruction) and `None` values are dropped;
- an empty (or blank) response follows nothing;
- the whole response is checked, reasoning included (unlike `ifeval`, which reads the text
  after `</think>`).

IFBench registers 83 ids: the 25 of IFEval (checks in `ifbench_classic`) and 58 of its own
(`ifbench_checks`). The ids whose IFBench checker needs NLTK's trained data, langdetect,
syllapy or emoji are listed in `UNSUPPORTED` with what they need. A row with such an id, an id
IFBench does not have, or without `instruction_id_list` raises (a reward error scored 0), so
that no row is graded on part of its instructions.
"""

from __future__ import annotations

from typing import Any

from relax_slurm.rewards.ifbench_checks import OOD, Check
from relax_slurm.rewards.ifbench_classic import CLASSIC
from relax_slurm.rewards.registry import RewardInput, register

_PUNKT = "NLTK's punkt sentence splitter (trained data)"
_TOKENIZE = "NLTK's word_tokenize (punkt data)"
UNSUPPORTED: dict[str, str] = {
    "language:response_language": "langdetect",
    "length_constraints:number_sentences": _PUNKT,
    "change_case:english_capital": "langdetect (English detection)",
    "change_case:english_lowercase": "langdetect (English detection)",
    "change_case:capital_word_frequency": _TOKENIZE,
    "ratio:stop_words": "NLTK's English stop word list",
    "ratio:sentence_type": _PUNKT,
    "ratio:sentence_balance": _PUNKT,
    "sentence:alliteration_increment": _PUNKT,
    "format:emoji": _PUNKT + " and the emoji package",
    "ratio:sentence_words": _PUNKT,
    "words:start_verb": "NLTK's POS tagger (trained data)",
    "sentence:keyword": _PUNKT,
    "count:pronouns": _TOKENIZE,
    "words:odd_even_syllables": "syllapy (syllable counts)",
    "words:last_first": _PUNKT,
    "sentence:increment": _PUNKT,
    "format:no_bullets_bullets": _PUNKT,
    "custom:word_reverse": _PUNKT,
    "custom:sentence_alphabet": _PUNKT,
    "words:keywords_specific_position": _PUNKT + " and " + _TOKENIZE,
    "words:words_position": _TOKENIZE,
    "format:title_case": _TOKENIZE,
}
CHECKS: dict[str, Check] = {**CLASSIC, **OOD}
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
