"""The long-tail task (relax_slurm/tiny/longtail.py), its reward and its preset."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from relax_slurm.config import register_configs, to_train_config
from relax_slurm.rewards import RewardInput, get_reward_fn
from relax_slurm.tiny import longtail
from relax_slurm.tiny.assets import ASSETS

CONF = Path(__file__).resolve().parents[3] / "conf"


def test_rows_repeat_the_digit_n_times():
    rows = longtail.make_rows(200, random.Random(1), "train")
    assert [r["id"] for r in rows[:2]] == ["train-0", "train-1"]
    for row in rows:
        d, n = row["prompt"][:-1].split("*")
        assert row["prompt"] == f"{d}*{n}=" and len(d) == 1
        assert row["label"] == d * int(n)
        assert 1 <= int(n) <= longtail.MAX_REPEAT


def test_repeat_counts_are_heavy_tailed():
    rng = random.Random(0)
    ns = sorted(longtail.draw_repeat(rng) for _ in range(20000))
    share = lambda k: sum(n >= k for n in ns) / len(ns)  # noqa: E731
    assert ns[len(ns) // 2] == 1  # most want one digit ...
    assert 0.75 < 1 - share(4) < 0.87  # ... about 81% at most three (1 - 4 ** -1.2) ...
    assert 0.01 < share(30) < 0.03  # ... and ~2% the cap (30 ** -1.2)
    assert ns[-1] == longtail.MAX_REPEAT


def test_draw_repeat_edges():
    class Fixed(random.Random):
        def __init__(self, x: float) -> None:
            super().__init__()
            self.x = x

        def random(self) -> float:
            return self.x

    assert longtail.draw_repeat(Fixed(0.0)) == 1  # u = 1
    assert longtail.draw_repeat(Fixed(0.5), alpha=1.0) == 2  # u = 0.5: 1 / 0.5
    assert longtail.draw_repeat(Fixed(1 - 1e-9)) == longtail.MAX_REPEAT  # capped
    assert longtail.draw_repeat(Fixed(1 - 1e-9), max_repeat=5) == 5


def test_prepare_writes_both_splits(tmp_path):
    train, test = longtail.prepare(tmp_path, n_train=30, n_test=7, seed=3)
    assert (train.name, test.name) == ("longtail_train.jsonl", "longtail_test.jsonl")
    assert len(train.read_text().splitlines()) == 30
    assert [json.loads(x)["id"] for x in test.read_text().splitlines()][-1] == "test-6"
    assert longtail.prepare(tmp_path / "again", n_train=30, n_test=7, seed=3)[0].read_text() \
        == train.read_text()  # seeded


def test_main_refuses_bad_arguments(tmp_path):
    for args in (["--alpha", "0"], ["--max-repeat", "0"], ["--n-train", "0"]):
        with pytest.raises(SystemExit):
            longtail.main(["--out", str(tmp_path), *args])
    assert longtail.main(["--out", str(tmp_path), "--n-train", "5", "--n-test", "1"]) == 0


def test_prefix_match_by_hand():
    score = get_reward_fn("prefix_match")

    def s(response: str, label: str, finish: str = "stop") -> float:
        return score(RewardInput(prompt="", response=response, label=label,
                                 finish_reason=finish))

    assert s("7777", "7777") == 1.0
    assert s(" 7777\n", "7777") == 1.0  # stripped
    assert s("7", "7777") == 0.25  # right start, stopped short
    assert s("777777", "777") == 0.5  # ran past the end
    assert s("7787", "7777") == 0.5  # the prefix ends at the first wrong digit
    assert s("8777", "7777") == 0.0
    assert s("", "77") == 0.0
    assert s("", "") == 1.0
    assert s("7777", "7777", "length") == 0.0  # truncated: never rewarded


def test_preset_loads_and_fits_the_task():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_train_config(compose("train", overrides=[
            "run_dir=/tmp/relax-test-run", "experiment=tiny_longtail_cpu"]))
    assert cfg.reward.name == "prefix_match"
    assert cfg.data.train_files == ["tiny/longtail_train.jsonl"]
    assert cfg.rollout.max_new_tokens > longtail.MAX_REPEAT  # the longest answer + EOS fits
    assert "longtail_train.jsonl" in ASSETS  # built on first use like the other tiny tasks
