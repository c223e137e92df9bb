"""load_tokenizer: the tokenizer AutoTokenizer would give, without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from transformers import AutoTokenizer

from relax_slurm.data.tokenizer import load_tokenizer, tokenizer_class_name
from tests.conftest import REPO

TEXTS = ["3+4=", "<|im_start|>user\n1+2=<|im_end|>", "unknown ✓ chars 12345"]


def test_same_tokenizer_as_autotokenizer(tiny_assets):
    path = tiny_assets / "model"
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        ids = auto(text)["input_ids"]
        assert ours.decode(ids) == auto.decode(ids)
    assert ours.get_vocab() == auto.get_vocab()
    assert (ours.eos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)


def test_the_rollout_worker_never_imports_torch(tiny_assets):
    """Nor `datasets` (pandas, pyarrow: ~1.5 CPU-s a start) for the .jsonl files it reads."""
    code = ("import sys; import relax_slurm.rollout.worker; from relax_slurm.data import "
            f"load_tokenizer, read_table; load_tokenizer({str(tiny_assets / 'model')!r}); "
            f"read_table({str(tiny_assets / 'arith_train.jsonl')!r}); "
            "print('torch' in sys.modules, 'datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False False", out.stderr[-2000:]


def test_unnamed_or_custom_classes_go_through_autotokenizer(tiny_assets, tmp_path):
    path = tmp_path / "tok"
    shutil.copytree(tiny_assets / "model", path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert tokenizer_class_name(path) == config["tokenizer_class"]
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {}}))
    assert tokenizer_class_name(path) is None
    del config["tokenizer_class"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_class_name(path) is None
    assert load_tokenizer(path)("1+2=")["input_ids"] == \
        AutoTokenizer.from_pretrained(tiny_assets / "model")("1+2=")["input_ids"]
    assert tokenizer_class_name(tmp_path / "missing") is None


def test_the_text_decoder_is_the_tokenizers_decode(tiny_assets):
    """The rewards' text straight from the tokenizers library gives `decode`'s string for every
    answer (special tokens, an empty one, numpy ids); a tokenizer that cleans up spaces or
    decodes its own way keeps transformers' path."""
    import numpy as np
    from transformers import PreTrainedTokenizerFast

    from relax_slurm.data.tokenizer import text_decoder

    tok = load_tokenizer(tiny_assets / "model")
    direct = text_decoder(tok)
    assert direct.__name__ == "direct"  # (the fast path is taken for the tiny model's)
    rng = np.random.default_rng(0)
    answers = [rng.integers(0, len(tok), int(n)).tolist() for n in rng.integers(0, 12, 200)]
    answers += [[], [tok.eos_token_id], tok("<|im_start|>user\n1+2=<|im_end|>")["input_ids"],
                np.array([5, 6, 7]), [np.int64(5), np.int64(9)]]
    for ids in answers:
        assert direct(ids) == tok.decode(ids, skip_special_tokens=True), ids

    tok.clean_up_tokenization_spaces = True
    assert text_decoder(tok).__name__ == "wrapped"

    class OwnDecode(type(tok)):  # type: ignore[misc,valid-type]
        def _decode(self, token_ids, **kw):
            return "mine"

    own = OwnDecode.from_pretrained(tiny_assets / "model")
    own.clean_up_tokenization_spaces = False
    assert isinstance(own, PreTrainedTokenizerFast) and text_decoder(own)([5]) == "mine"
