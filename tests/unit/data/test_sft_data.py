"""SFT rows -> prompt, response and loss mask: prompt tokens are never trained; epochs, seeds and
resume of the row order; errors name the row and the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relax_slurm.config.data import DataConfig
from relax_slurm.config.sft import SFTConfig
from relax_slurm.data.sft import EpochSampler, conversation_pieces, encode_example, read_examples
from relax_slurm.errors import DataError

EOS = 1


@pytest.fixture(scope="module")
def tok():
    from relax_slurm.tiny.model import build_tokenizer

    return build_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_prompt_is_context_and_the_answer_with_its_eos_is_trained(tok):
    e = encode_example(tok, [user("3+4="), assistant("7")], apply_chat_template=True)
    # the prompt is exactly what the rollout sends the engine (template + generation prompt)
    assert e.prompt_ids.tolist() == ids(tok, "3+4=") == tok.apply_chat_template(
        [user("3+4=")], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert e.response_ids.tolist() == ids(tok, "7") + [EOS]
    assert e.loss_mask.tolist() == [1.0, 1.0]


def test_multi_turn_trains_every_assistant_turn_and_nothing_else(tok):
    e = encode_example(tok, [user("3+4="), assistant("7"), user("1+1="), assistant("2")], True)
    assert e.prompt_ids.tolist() == ids(tok, "3+4=")
    assert e.response_ids.tolist() == [*ids(tok, "7"), EOS, *ids(tok, "1+1="), *ids(tok, "2"), EOS]
    assert e.loss_mask.tolist() == [1, 1, 0, 0, 0, 0, 1, 1]


def test_raw_text_rows_end_with_eos(tok):
    e = encode_example(tok, [{"role": "system", "content": "0"}, user("3+4="), assistant("7")],
                       apply_chat_template=False)
    assert e.prompt_ids.tolist() == ids(tok, "0\n3+4=") and e.response_ids[-1] == EOS
    assert e.loss_mask.tolist() == [1.0, 1.0]


def test_raw_text_rows_are_one_prompt_and_one_answer(tok):
    with pytest.raises(ValueError, match="multi-turn rows need the template"):
        encode_example(tok, [user("3+4="), assistant("7"), user("1+1="), assistant("2")], False)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    class StripsPastThinking:  # like templates that drop past turns' reasoning
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "".join(m["content"].split("</think>")[-1]
                           if m["role"] == "assistant" and i < len(messages) - 1
                           else m["content"] for i, m in enumerate(messages))

    msgs = [user("q"), assistant("<think>r</think>a"), user("q2"), assistant("b")]
    with pytest.raises(ValueError, match="renders the turns before message"):
        conversation_pieces(StripsPastThinking(), msgs)


def test_read_rows_with_a_label_column_and_system_prompt(tok, tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "3+4=", "label": 7},
                                           {"prompt": "1+1=", "label": "2"}])
    rows = read_examples([str(f)], DataConfig(train_files=[str(f)], system_prompt="0"),
                         SFTConfig(response_key="label"), tok)
    assert [r.prompt_ids.tolist() for r in rows] == [ids(tok, "03+4="), ids(tok, "01+1=")]
    # a number read back from jsonl is trained as its text
    assert [r.response_ids.tolist() for r in rows] == [[*ids(tok, "7"), EOS], [*ids(tok, "2"), EOS]]


def test_messages_column_and_length_filter(tok, tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [user("3+4="), assistant("7")]},
        {"messages": [user("1+1=" * 10), assistant("2")]},
    ])
    rows = read_examples([str(f)], DataConfig(train_files=[str(f)]),
                         SFTConfig(messages_key="messages", max_tokens=10), tok)
    assert len(rows) == 1 and rows[0].loss_mask.tolist() == [1.0, 1.0]
    with pytest.raises(DataError, match="no row to train on"):
        read_examples([str(f)], DataConfig(train_files=[str(f)]),
                      SFTConfig(messages_key="messages", max_tokens=2), tok)


@pytest.mark.parametrize("row,match", [
    ({"prompt": "3+4="}, r"no column 'response'.*sft.response_key"),
    ({"prompt": "3+4=", "response": None}, r"row 0, key 'response': missing"),
    ({"messages": [user("3+4=")]}, r"row 0, key 'messages': no assistant tokens"),
    ({"messages": [assistant("7")]}, r"row 0, key 'messages'.*no context"),
])
def test_errors_name_the_row_and_key(tok, tmp_path, row, match):
    f = write_jsonl(tmp_path / "bad.jsonl", [row])
    sft = SFTConfig(messages_key="messages" if "messages" in row else None)
    with pytest.raises(DataError, match=match):
        read_examples([str(f)], DataConfig(train_files=[str(f)]), sft, tok)


def test_epochs_are_seeded_permutations_and_batches_run_across_them():
    s = EpochSampler(5, seed=3, shuffle=True)
    first = s.take(5)
    assert sorted(first) == list(range(5))
    assert first == np.random.default_rng(3).permutation(5).tolist()
    assert s.epochs_done == 1.0
    across = s.take(3)  # starts epoch 1: seed 3 + 1
    assert across == np.random.default_rng(4).permutation(5).tolist()[:3]
    assert EpochSampler(4, seed=0, shuffle=False).take(6) == [0, 1, 2, 3, 0, 1]


def test_resume_continues_with_exactly_the_next_rows():
    straight = EpochSampler(7, seed=1, shuffle=True)
    straight.take(10)
    state = straight.state_dict()
    resumed = EpochSampler(7, seed=1, shuffle=True)
    resumed.load_state_dict(state)
    assert resumed.take(9) == straight.take(9)
    with pytest.raises(DataError, match="had 7 rows, this one has 8"):
        EpochSampler(8, seed=1, shuffle=True).load_state_dict(state)
