"""CPU compatibility layer for megatron-core 0.16 and megatron-bridge 0.3 (no GPU present).

Everything that makes Megatron run on a CPU-only torch lives here, and nothing here runs when
CUDA is available. What it does and why:

- megatron-core forks a CUDA RNG tracker for dropout and initialisation: a tracker backed by
  CPU generators replaces it (`get_cuda_rng_tracker` keeps its contract: add/fork/get_states);
  activation recompute's save and restore of the CUDA generator's state are no-ops.
- RoPE, the optimizer and the schedules call `torch.cuda.current_device()`, `.cuda()` and pass
  `device="cuda"` literals: those are answered with the CPU (a process-wide TorchFunctionMode
  rewrites a `device=` keyword naming CUDA; `.cuda()`, `synchronize`, `empty_cache` are no-ops).
- MoE: megatron-core's moe_utils names transformer-engine kernels it never imported (they are
  set to None, which its code tests for).
- gradient clipping asserts `torch.cuda.FloatTensor` grads: a CPU clip (same coefficient,
  max_norm / (total_norm + 1e-6)) replaces it in megatron's optimizer.
- the distributed optimizer (`trainer.use_distributed_optimizer`) sorts parameters by
  `param.type()` and accepts only `torch.cuda.{Float,Half,BFloat16}Tensor`: while it is built,
  CPU tensors answer with those names (its buffers and collectives are device-agnostic: gloo
  does the reduce-scatter and all-gather). Loading its checkpoint state copies every key of
  torch Adam's per-parameter state, "step" included, which the loader does not pass (torch's
  Adam is megatron-core's fallback without TE/Apex): "step" is left as it is; and the loader
  hands every parameter one shared "step" tensor, which Adam would increment once per
  parameter: each gets its own copy. And building its checkpoint state for a load reads the
  common "step" off torch Adam's per-parameter state (`state_dict`: `assert len(steps) == 1`),
  which a fresh optimizer (a run resuming in a new process, before any step) does not have
  yet: its state is first set to what torch's Adam starts from (step 0, zero moments), which
  the load then overwrites (the GPU path, with TE/Apex, reads the step off the param groups).
- sequence parallelism (megatron-core trains MoE layers at TP > 1 only with it): the local
  layers' torch norm asserts it off (torch_norm.py:32), though a norm is per token and so
  exact on each TP rank's slice of the sequence. What the TP ranks' slices still need is their
  norm weights' gradients summed over the TP group, which finalize_model_grads does for
  parameters tagged `sequence_parallel` (as transformer-engine's norms and the MoE router tag
  theirs): the norm is built with the flag off in a copy of the config, then tagged.
- megatron-bridge imports `transformer_engine` and `triton` at module level, and neither
  installs on CPU: stub modules are registered, *after* every megatron.core module was
  imported, so megatron.core still sees `HAVE_TE=False` and builds its local (non-TE) layers.
  Anything that actually uses a stubbed class raises a clear error.
- megatron-core's `jit_fuser` is torch.compile (megatron/core/jit.py, at import), which ~40
  functions (the fusions, a few activations) are decorated with while megatron.core imports;
  the first torch.compile call of a process sets up dynamo (0.4-1.6 CPU-s of a rank's import,
  median 0.8 over four alternated pairs), in every rank and conversion. On CPU the fusions
  are off (model.py) and none of those functions runs on the paths used here, so
  `megatron.core.jit` is registered before megatron.core imports with its fuser left as its
  own no-op decorator (what its `disable_jit_fuser` sets).
- megatron-bridge's row-parallel mapping scatters `torch.chunk(dim=1)` views; on GPU the
  `.to("cuda")` copies them, on CPU gloo sends the views' raw storage (wrong bytes at TP>1).
  The splits are made contiguous before the scatter.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import logging
import pkgutil
import sys
import types

import torch

log = logging.getLogger("relax_slurm.trainer.megatron")

_ACTIVE = False


def needed() -> bool:
    """True when no GPU is present: the layer is applied only then."""
    return not torch.cuda.is_available()


# ---- megatron-core on CPU -------------------------------------------------------------------

def _cpu_device(d):
    if isinstance(d, str) and d.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    return d


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Rewrites `device="cuda"` keywords of torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_cpu_device(kwargs["device"]))
        return func(*args, **kwargs)


def _install_rng_tracker(seed: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mr

    class CPURNGStatesTracker(mr.CudaRNGStatesTracker):
        """megatron's RNG tracker with CPU generator states in place of CUDA ones."""

        def add(self, name, seed):
            self._is_initialized = True
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mr._MODEL_PARALLEL_RNG_TRACKER_NAME):
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    tracker = CPURNGStatesTracker()
    tp = ps.get_tensor_model_parallel_rank()
    ep = ps.get_expert_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    # the offsets megatron's model_parallel_cuda_manual_seed uses
    tracker.add(mr._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mr._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp)
    tracker.add(mr._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 * ep + tp)
    mr._CUDA_RNG_STATE_TRACKER = tracker
    mr._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # activation recompute (trainer.recompute) saves the CUDA generator's state before a
    # checkpointed forward and restores it for the replay: there is none on CPU (torch's CPU
    # generator is saved beside it, and the tracker's states above are CPU ones)
    mr._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mr._set_cuda_rng_state = lambda *args, **kwargs: None


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's clip_grad_by_total_norm_fp32 without its CUDA assertion and kernels."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
            if g is not None:
                g.detach().mul_(coeff)


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _cuda_type_names():
    """`tensor.type()` (no argument) names CPU float tensors as their CUDA counterparts."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    own = "type" in torch.Tensor.__dict__
    torch.Tensor.type = type_
    try:
        yield
    finally:
        if own:
            torch.Tensor.type = original
        else:
            del torch.Tensor.type  # back to TensorBase's


def _distributed_optimizer_on_cpu() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    init = DistributedOptimizer.__init__
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def __init__(self, *args, **kwargs):
        with _cuda_type_names():
            init(self, *args, **kwargs)

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # torch's Adam (what megatron-core falls back to without TE/Apex) keeps a per-parameter
        # "step" the checkpoint loaders leave out of `tensors` (they restore it from the param
        # groups) but the setter copies every state key: it is kept as it is
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        set_states(self, model_param, tensors)

    state_dict = DistributedOptimizer.state_dict

    def state_dict_(self):
        inner = self.optimizer
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) and not inner.state:
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}
        return state_dict(self)

    load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        load(self, state_dict)
        # the loader gives every parameter's state the *same* "step" tensor, which torch's Adam
        # then increments in place once per parameter: each gets its own copy
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    DistributedOptimizer.__init__ = __init__
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer.state_dict = state_dict_


def _sequence_parallel_torch_norm() -> None:
    """WrappedTorchNorm under sequence parallelism (the module docstring says why)."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_relax_sequence_parallel", False):
        return

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = True  # its gradient summed over the TP group
        return norm

    __new__._relax_sequence_parallel = True
    WrappedTorchNorm.__new__ = staticmethod(__new__)


def activate(seed: int) -> bool:
    """Apply the megatron-core shims (after `initialize_model_parallel`); False with a GPU.

    Replaces megatron's `model_parallel_cuda_manual_seed(seed)` on CPU.
    """
    global _ACTIVE
    if not needed():
        return False
    torch.manual_seed(seed)
    _install_rng_tracker(seed)
    if _ACTIVE:
        return True
    from megatron.core.optimizer import optimizer as mopt
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16 binds these only when transformer-engine imports, then tests them
    # against None (the MoE router's `te_general_gemm` raises NameError instead)
    for name in ("te_general_gemm", "fused_permute", "fused_permute_with_probs",
                 "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_unpermute", "fused_topk_with_score_function",
                 "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)

    mopt.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    _sequence_parallel_torch_norm()
    _distributed_optimizer_on_cpu()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    # megatron-bridge's Qwen3VLModel.forward (modelling_qwen3_vl/model.py:260) marks NVTX
    # ranges unconditionally; without CUDA they raise
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    _CudaToCpu().__enter__()  # for the life of the process
    _ACTIVE = True
    log.info("megatron CPU compatibility layer active (no GPU)")
    return True


# ---- megatron-bridge on CPU -----------------------------------------------------------------

def local_vl_layer_specs() -> None:
    """megatron-bridge 0.3.1's Qwen3-VL providers (qwen_vl/qwen3_vl_provider.py:114 dense,
    :257 MoE) build their language layers with transformer-engine's spec unconditionally (on
    CPU: NameError TESpecProvider). megatron-core's local spec instead, as the GPT providers
    use on CPU (gpt_provider.local_layer_spec); the MoE's grouped GEMM is transformer-engine's
    too."""
    from megatron.bridge.models.qwen_vl import qwen3_vl_provider as qp
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, **_):
        return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                        qk_layernorm=qk_layernorm, normalization="RMSNorm")

    qp.get_gpt_layer_with_transformer_engine_spec = local_spec


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(name)


def _stub_class(name: str) -> type:
    def refuse(self, *a, **k):
        raise RuntimeError(f"{name} needs transformer_engine, which is stubbed on CPU; "
                           "use the local layer spec (the megatron backend does)")
    return _StubMeta(name, (object,), {"__init__": refuse})


def _stub_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _stub_class(attr)

    mod.__getattr__ = missing  # PEP 562: any class name resolves to a refusing stub
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__path__ = []
    mod.__version__ = "0.0.0"
    mod.__file__ = f"<cpu stub {name}>"
    return mod


_TE_MODULES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
               "transformer_engine.common.recipe", "transformer_engine.pytorch.module",
               "transformer_engine.pytorch.float8_tensor", "transformer_engine.pytorch.tensor",
               "transformer_engine.pytorch.distributed",
               "transformer_engine.pytorch.cpp_extensions")


def _preimport_megatron_core() -> None:
    """Import megatron.core's modules while transformer_engine is absent: they bind
    HAVE_TE=False."""
    import megatron.core as mc

    for info in pkgutil.walk_packages(mc.__path__, "megatron.core."):
        if ".extensions.transformer_engine" in info.name or "kitchen" in info.name:
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # optional modules (e.g. ones needing apex): not used here
            pass
    # `from megatron.core.extensions.transformer_engine import ...` -> ImportError, as without TE
    sys.modules.setdefault("megatron.core.extensions.transformer_engine", None)


def plain_jit_fuser() -> None:
    """`megatron.core.jit` with `jit_fuser` the no-op decorator, registered before
    megatron.core is imported (after that it has decorated everything: nothing to do). Its
    names and functions are the real module's; only the import-time `enable_jit_fuser()` is
    left out."""
    if "megatron.core.jit" in sys.modules or "megatron.core" in sys.modules:
        return
    jit = types.ModuleType("megatron.core.jit")
    jit.__spec__ = importlib.machinery.ModuleSpec("megatron.core.jit", None)
    jit.__file__ = "<relax_slurm cpu_compat: megatron.core.jit without torch.compile>"

    def noop_decorator(func):
        return func

    def enable_jit_fuser() -> None:
        jit.jit_fuser = torch.compile

    def disable_jit_fuser() -> None:
        jit.jit_fuser = noop_decorator

    jit.noop_decorator, jit.jit_fuser = noop_decorator, noop_decorator
    jit.enable_jit_fuser, jit.disable_jit_fuser = enable_jit_fuser, disable_jit_fuser
    sys.modules["megatron.core.jit"] = jit


def install_triton_stub() -> None:
    """`triton` as a stub module when it is not installed (CPU): the packages that import it
    at module level (megatron-bridge, SGLang's server_args) then import; nothing calls it."""
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass
    t, tl = _stub_module("triton"), _stub_module("triton.language")
    t.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    t.autotune = lambda *a, **kw: (lambda f: f)
    t.heuristics = lambda *a, **kw: (lambda f: f)
    t.Config = lambda *a, **kw: None
    t.cdiv = lambda a, b: -(-a // b)
    t.next_power_of_2 = lambda n: 1 << (n - 1).bit_length()
    tl.constexpr = object
    t.language = tl
    sys.modules["triton"], sys.modules["triton.language"] = t, tl


def _contiguous_row_splits() -> None:
    from megatron.bridge.models.conversion import param_mapping as pm

    original = pm.MegatronParamMapping.scatter_to_tp_ranks
    if getattr(original, "_relax_contiguous", False):
        return

    def scatter_to_tp_ranks(self, splits, *a, **k):
        return original(self, [s.contiguous() for s in splits] if splits else splits, *a, **k)

    scatter_to_tp_ranks._relax_contiguous = True
    pm.MegatronParamMapping.scatter_to_tp_ranks = scatter_to_tp_ranks


def import_bridge():
    """`megatron.bridge` (the module), importable on CPU; plain import with a GPU."""
    if needed() and "megatron.bridge" not in sys.modules:
        _preimport_megatron_core()
        install_triton_stub()
        for name in _TE_MODULES:
            sys.modules.setdefault(name, _stub_module(name))
    import megatron.bridge as bridge

    if needed():
        _contiguous_row_splits()
    return bridge


if needed():  # every megatron path imports this module before megatron.core (plain_jit_fuser)
    plain_jit_fuser()
