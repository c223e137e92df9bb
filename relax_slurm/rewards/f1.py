"""SQuAD token F1 between the response and the label (or the best of several labels).

Both sides are normalised as in SQuAD's evaluation: lower-cased, punctuation (any Unicode
punctuation) removed, the articles a/an/the removed, whitespace collapsed. F1 is
2 * precision * recall / (precision + recall) over the multiset of shared tokens; two empty
answers score 1. Text after `</think>` is graded when there is one.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

from relax_slurm.rewards.extract import final_text, label_list
from relax_slurm.rewards.registry import RewardInput, register

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_tokens(text: str) -> list[str]:
    """SQuAD normalisation, split into tokens.

    >>> normalize_tokens("The Eiffel-Tower, in  Paris!")
    ['eiffeltower', 'in', 'paris']
    >>> normalize_tokens("Ça coûte 5€.")
    ['ça', 'coûte', '5€']
    """
    text = "".join(c for c in text.lower() if not unicodedata.category(c).startswith("P"))
    return _ARTICLES.sub(" ", text).split()


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 of two answers.

    >>> token_f1("the cat sat", "a cat sat down")
    0.8
    >>> token_f1("", ""), token_f1("cat", "")
    (1.0, 0.0)
    """
    pred, ref = normalize_tokens(prediction), normalize_tokens(gold)
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


@register("f1")
def f1_reward(inp: RewardInput) -> float:
    """The best token F1 of the response against the label's acceptable answers.

    >>> f1_reward(RewardInput(prompt="", response="Paris, France", label=["Paris", "France"]))
    0.6666666666666666
    """
    answer = final_text(inp.response)
    return max((token_f1(answer, str(gold)) for gold in label_list(inp.label)), default=0.0)
