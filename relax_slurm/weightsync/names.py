"""The names a weight sync sends, checked against what the engines loaded: model.path's
checkpoint files.

SGLang's loaders map checkpoint names onto their own parameters and skip a name they do not
know with one line in the engine's log ("Parameter ... not found in params_dict"; measured on
the real SGLang 0.5.23 serving Qwen3, and a wrong shape went through as silently): the update
answers success, the engine keeps serving the old tensor under the new version's label, and
the run trains off-policy without a word. The hf engine refuses an unknown name, but it also
takes transformers' in-memory names, so a trainer that sent those would pass every hf-engine
run and fail silently on SGLang. So rank 0 checks each name the first time it sends it: a name
the checkpoint files do not hold stops the run, naming it.

What SGLang takes beyond the files' own names, and so does this check: a fused experts tensor
on file (`...experts.gate_up_proj`, Qwen3-VL-MoE) under its per-expert names
(`...experts.{e}.gate_proj.weight`, what `modeling.checkpoint_views` sends), and an output
head a tied checkpoint does not store (`lm_head.weight`: SGLang skips it, the embedding is the
head).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from relax_slurm.errors import ConfigError
from relax_slurm.weightsync.adapter import Adapter

PER_EXPERT = re.compile(r"^(?P<stem>.+\.experts)\.\d+\.(?P<kind>gate_proj|up_proj|down_proj)"
                        r"\.weight$")
FUSED_ON_FILE = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def known_to_engines(name: str, on_file: set[str] | frozenset[str]) -> bool:
    """Whether an engine that loaded the checkpoint holding `on_file` takes `name`."""
    if name in on_file:
        return True
    expert = PER_EXPERT.match(name)
    if expert and f"{expert['stem']}.{FUSED_ON_FILE[expert['kind']]}" in on_file:
        return True
    return name.endswith("lm_head.weight")  # on file or not: a tied head is skipped


class NameCheck:
    """What rank 0 holds for the run: the checkpoint's names and shapes (none when model.path
    has no weight files to read: nothing is checked), and the names already found there."""

    def __init__(self, model_path: str | Path) -> None:
        from relax_slurm.checkpoint.hf_files import weight_shapes

        self.model_path = str(model_path)
        self.shapes = weight_shapes(Path(model_path))
        self.on_file = frozenset(self.shapes)
        self.known: set[str] = set()

    def check(self, name: str, shape: Sequence[int] | None = None) -> None:
        """ConfigError, naming it, when the engines would skip `name`, or take a tensor of
        `shape` under it that is not the one they hold."""
        if name in self.known or not self.on_file:
            return
        if not known_to_engines(name, self.on_file):
            raise ConfigError(self.refusal(name))
        held = self.shapes.get(name)
        if shape is not None and held is not None and tuple(shape) != tuple(held):
            raise ConfigError(
                f"weight sync: the trainer sends {name!r} of shape {tuple(shape)}, which the "
                f"checkpoint the engines loaded (model.path={self.model_path}) holds as "
                f"{tuple(held)}. SGLang takes it without a word (measured: the update answers "
                "success); the trainer's model is not the one the engines serve")
        self.known.add(name)

    def checked(self, weights):
        """A sync's weights, checked: a list at once, a stream (an export that gathers tensor
        after tensor) as it comes, each name before its tensor goes on; an Adapter as it is
        (its own route, names PEFT's)."""
        if isinstance(weights, Adapter):
            return weights
        if isinstance(weights, Iterator):
            return self._stream(weights)
        for name, tensor in weights:
            self.check(name, tensor.shape)
        return weights

    def _stream(self, named: Iterable) -> Iterator:
        for name, tensor in named:
            self.check(name, tensor.shape)
            yield name, tensor

    def refusal(self, name: str) -> str:
        tail = name.rsplit(".", 2)[-2:]
        near = sorted(n for n in self.on_file if n.rsplit(".", 2)[-2:] == tail)
        hint = f" (the files hold e.g. {near[0]!r})" if near else ""
        return (f"weight sync: the trainer sends {name!r}, which the checkpoint the engines "
                f"loaded (model.path={self.model_path}) does not hold{hint}. SGLang skips a "
                "name its model does not know and keeps serving the old tensor, so the run "
                "would train off-policy without a word. The trainer must send the files' names "
                "(relax_slurm/modeling.py checkpoint_names: transformers 5 renames some "
                "models' parameters in memory; a megatron bridge exports the files' names)")
