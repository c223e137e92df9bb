"""A model's MoE layout from its config.json, and the routed-experts array format.

SGLang (0.5.21+, started with `--enable-return-routed-experts`) answers a /generate request
that sets `return_routed_experts: true` with `meta_info.routed_experts`: base64 of int32 ids
shaped [seqlen - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok], one row
per token that went through a forward pass (every prompt token and every generated token but
the last), one column per decoder layer (dense layers' columns hold nothing meaningful). The hf
engine answers the same. Samples carry the array flattened, as int16 (`ROUTING_DTYPE`): a
quarter of the JSON's bytes and half of int32's, and room for 32k experts.

No torch here: the rollout worker reads these without importing it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROUTING_DTYPE = np.dtype(np.int16)
WIRE_DTYPE = np.dtype("<i4")  # SGLang's: numpy int32 bytes, base64


@dataclass(frozen=True)
class RoutingShape:
    """The MoE layout of a text decoder."""

    layers: int
    """num_hidden_layers: the routed-experts array has one column per decoder layer."""
    topk: int
    """num_experts_per_tok."""
    experts: int
    moe_layers: tuple[int, ...]
    """The decoder layers with a router (the others are dense)."""

    def tokens(self, flat_len: int, where: str = "routed_experts") -> int:
        """How many tokens a flattened array of `flat_len` ids covers."""
        per_token = self.layers * self.topk
        if flat_len % per_token:
            raise ValueError(f"{where}: {flat_len} expert ids is not a whole number of tokens "
                             f"of {self.layers} layers x {self.topk} experts")
        return flat_len // per_token


def text_config(config: dict) -> dict:
    """The text decoder's part of a config.json (multimodal models nest it)."""
    for key in ("thinker_config", "text_config"):
        if isinstance(config.get(key), dict):
            return text_config(config[key])
    return config


def routing_shape_of(config: dict) -> RoutingShape | None:
    """The MoE layout of a config.json's text decoder, or None for a dense model."""
    text = text_config(config)
    experts = next((int(text[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if text.get(k)), 0)
    if experts <= 0 or not text.get("num_experts_per_tok"):
        return None
    layers = int(text["num_hidden_layers"])
    dense = set(text.get("mlp_only_layers") or ())
    step = int(text.get("decoder_sparse_step") or 1)
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return RoutingShape(layers=layers, topk=int(text["num_experts_per_tok"]), experts=experts,
                        moe_layers=moe_layers)


def routing_shape(model_path: str | Path) -> RoutingShape | None:
    """`routing_shape_of` the model directory's config.json (None if there is none)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    return routing_shape_of(json.loads(path.read_text()))


def encode_routed_experts(ids: np.ndarray) -> str:
    """[tokens, layers, topk] ids as SGLang sends them: base64 of the int32 bytes."""
    return base64.b64encode(np.ascontiguousarray(ids, dtype=WIRE_DTYPE).tobytes()).decode("ascii")


def decode_routed_experts(text: str, shape: RoutingShape, tokens: int) -> np.ndarray:
    """An engine's meta_info.routed_experts as a sample's flat int16 array, checked against the
    model's layout and the number of tokens it must cover (prompt + response - 1 -
    routed_experts_start_len)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"meta_info.routed_experts is not base64: {e}") from e
    if len(raw) % WIRE_DTYPE.itemsize:
        raise ValueError(f"meta_info.routed_experts: {len(raw)} bytes is not a whole number of "
                         "int32 ids")
    ids = np.frombuffer(raw, dtype=WIRE_DTYPE)
    got = shape.tokens(len(ids), "meta_info.routed_experts")
    if got != tokens:
        raise ValueError(f"meta_info.routed_experts covers {got} tokens, expected {tokens} "
                         "(prompt + response - 1 - routed_experts_start_len)")
    # one reduction for both bounds: a negative int32 read as uint32 is above any expert count
    if len(ids) and ids.view(np.uint32).max() >= shape.experts:
        raise ValueError("meta_info.routed_experts holds expert ids outside "
                         f"0..{shape.experts - 1}")
    return ids.astype(ROUTING_DTYPE)
