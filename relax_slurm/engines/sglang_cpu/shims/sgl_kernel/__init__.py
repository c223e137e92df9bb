"""Pure-torch stand-in for the CPU build of sgl-kernel (docs/engines.md#sglang-on-cpu).

With SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.2x imports a few CPU ops from `sgl_kernel` at module
level (mem_cache/allocation.py, kernels/ops/kvcache/cache_move.py, kernels/ops/speculative/*).
The CPU sgl-kernel is not published on PyPI (it is built from the sglang repo's sgl-kernel with
pyproject_cpu.toml). This stub implements the one op on the plain-serving path in torch and makes
every other name a function that raises NotImplementedError when called. torch.ops.sgl_kernel has
no `convert_weight_packed`, so SGLang's cpu_has_amx_support() is False and its layers take their
forward_native paths.
"""

import torch

__version__ = "0.0.0+cpu-torch-stub"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th slice of out_cache_loc
    (the slices laid end to end, in batch order): SGLang's triton assign_req_to_token_pool."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    off = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[off:off + n].to(req_to_token.dtype)
        off += n


def _missing(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not provided by the CPU torch stub")

    fn.__name__ = name
    return fn


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
