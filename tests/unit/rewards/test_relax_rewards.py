"""geo3k, ifbench and dapo-genrm score as Relax's rewards of those names: hand-written cases.

The judge of dapo-genrm is a real HTTP server of the test's own (the one test_remote_genrm uses),
answering in the shape of an engine's /generate.
"""

from __future__ import annotations

import pytest

from relax_slurm.rewards import score


# --- geo3k: 0.9 * accuracy (mathruler) + 0.1 * format (<think>...</think> ... \boxed{}) ---

@pytest.mark.parametrize("response,label,expected", [
    (r"<think>AB = 2r</think> So \boxed{14}.", "14", 1.0),
    (r"The answer is \boxed{14}", "14", 0.9),                     # right, no <think>
    (r"<think>hmm</think> \boxed{13}", "14", 0.1),                # in format, wrong
    ("<think>hmm</think> the answer is 14", "14", 0.0),           # no box: neither
    (r"<think>r</think> \boxed{3\sqrt{3}}", r"3\sqrt{3}", 1.0),
    (r"\boxed{3 \sqrt 3}", r"3\sqrt{3}", 0.9),                   # mathruler's normalisation
    (r"<think>x</think>\boxed{60^\circ}", "60", 1.0),             # degrees dropped
    (r"\boxed{2/4}", r"\frac{1}{2}", 0.0),                       # unreduced fraction: wrong
    (r"\boxed{3} then cut off \boxed{4", "3", 0.0),               # last \boxed{ open: "None"
    (r"\boxed{5}", {"ground_truth": "5"}, 0.9),                   # Relax's dict label
    (r"\boxed{5}", {"answer": "5"}, 0.9),
    (r"\boxed{5}", ["4", "5"], 0.9),                              # any of the labels
    (r"\boxed{5}", None, 0.0),
    (r"\boxed{5}", "", 0.0),
])
def test_geo3k(response, label, expected):
    assert score("geo3k", response, label) == expected


