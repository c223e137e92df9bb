"""On CPU megatron-core imports without calling torch.compile: its `jit_fuser` (torch.compile,
set when megatron/core/jit.py imports) decorates ~40 functions while megatron.core imports, and
the first torch.compile call of a process sets up dynamo (0.4-1.6 CPU-s, median 0.8), paid by
every megatron rank and conversion of the suite. cpu_compat leaves the fuser as megatron's own
no-op decorator; the functions stay what they compute."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.bridge") is None,
                                reason="pip install --no-deps megatron-bridge==0.3.1")

ROOT = Path(__file__).resolve().parents[3]
PROBE = """
import torch
from relax_slurm.trainer.megatron import cpu_compat
cpu_compat.import_bridge()
import megatron.core.jit as jit
from megatron.core.transformer.utils import erf_gelu, gelu_impl
from megatron.core.fusions.fused_bias_swiglu import swiglu
assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser
for fn in (gelu_impl, erf_gelu, swiglu):  # plain functions, not dynamo's wrappers
    assert not hasattr(fn, "_torchdynamo_orig_callable"), fn
x = torch.linspace(-3, 3, 61)
torch.testing.assert_close(erf_gelu(x), torch.nn.functional.gelu(x), rtol=1e-4, atol=1e-4)
torch.testing.assert_close(gelu_impl(x), torch.nn.functional.gelu(x, approximate="tanh"))
y = torch.linspace(-2, 2, 8)
torch.testing.assert_close(swiglu(y), torch.nn.functional.silu(y[:4]) * y[4:])
jit.enable_jit_fuser()  # megatron's own switch still works
assert jit.jit_fuser is torch.compile
print("ok")
"""


def test_megatron_core_imports_on_cpu_without_torch_compile():
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
