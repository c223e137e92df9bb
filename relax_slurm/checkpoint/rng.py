"""Every RNG a rank draws from (torch, CUDA, Python, NumPy), saved beside its checkpoint shard
(`rng/rank_<r>.pt`) and restored on resume, so a resumed run draws what the uninterrupted one
would have."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch


def save_rng(path: Path) -> None:
    """Plain tensors, ints and lists only, so it loads with torch.load(weights_only=True)."""
    np_state = np.random.get_state(legacy=False)
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [py_version, list(py_state), py_gauss],
        "numpy": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def load_rng(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    n = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937",
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
