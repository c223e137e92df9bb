"""Loaded at interpreter start in the CPU SGLang venv (by relax_sglang_cpu_shim.pth), only when
SGLANG_USE_CPU_ENGINE=1, i.e. in the server (its scheduler and detokenizer processes are forked
from it, below, and inherit all of it): what a torch without CUDA needs for SGLang's GPU code
paths to start (each below, with why).

torchvision 0.28.0 from PyPI is a CUDA build: its _C.so cannot load against the CPU torch, so
the torchvision::nms and ::qnms operators are never defined and `import torchvision` dies in
torchvision/_meta_registrations.py (register_fake("torchvision::nms")). SGLang imports
torchvision.transforms while it imports its model configs. Defining the two operators' schemas
(no kernels) lets those registrations succeed; nothing on the text path calls nms.
"""

import os
import sys

# Bytecode: pip installed this venv without compiling it (`--no-compile`: 27,000 files, of
# which a server imports ~7,000), and the build compiled what a server imports
# (sglang_cpu.WARM_IMPORTS). Anything else a process of this venv imports is compiled once
# and kept, whatever PYTHONDONTWRITEBYTECODE says (set on CI and many images): this venv is
# the project's own cache, and without it every server would compile those modules again.
sys.dont_write_bytecode = False

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    try:
        import torch

        _TORCHVISION = torch.library.Library("torchvision", "FRAGMENT")
        _TORCHVISION.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # already defined (a working torchvision), or no torch yet
        pass
    # SGLang's multimodal processors for Qwen-VL (multimodal/processors/qwen_vl.py) import
    # models/qwen3_5.py, which reads these CPU sgl-kernel ops at module level; the import fails,
    # the processor is never registered, and a Qwen2.5-VL / Qwen3-VL server refuses to start
    # ("No processor registered for architecture"). Their schemas (no kernels) let it import;
    # the Qwen-VL models do not call them (Qwen3.5 models would, and fail naming the op).
    try:
        import torch

        _SGL_KERNEL = torch.library.Library("sgl_kernel", "FRAGMENT")
        for _op in ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu",
                    "fused_qk_gemma_rmsnorm_with_gate_cpu",
                    "fused_qkvzba_split_reshape_cat_contiguous_cpu"):
            _SGL_KERNEL.define(f"{_op}(Tensor[] args) -> ()")
    except Exception:  # a real CPU sgl-kernel defines them
        pass
    # SGLang's LoRA layers and its torch_native LoRA backend pin host memory unconditionally
    # (torch.tensor(..., pin_memory=True) in lora/layers.py, .pin_memory() per batch in
    # lora/backend/torch_backend.py); a torch without an accelerator refuses, and a server
    # started with --enable-lora dies at start. Without an accelerator pinning means nothing:
    # the host tensor is returned as it is.
    try:
        import functools

        import torch

        if not torch.cuda.is_available():
            torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

            def _unpinned(factory):
                @functools.wraps(factory)
                def make(*args, pin_memory=False, **kwargs):
                    return factory(*args, **kwargs)
                return make

            for _name in ("tensor", "empty", "zeros", "ones", "full", "arange"):
                setattr(torch, _name, _unpinned(getattr(torch, _name)))
    except Exception:  # no torch yet
        pass
    # mem_cache/pool_host/common.py, patched when it is first imported (a finder ahead of the
    # others wraps its exec_module; importing SGLang here, at interpreter start, would be too
    # early and slow): the host cache of --enable-return-routed-experts (R3;
    # state_capturer/base.py BaseHostCache) allocates through ALLOC_MEMORY_FUNCS[device], whose
    # default pins with torch.cuda.cudart().cudaHostRegister; without CUDA the scheduler dies
    # at start ("Torch not compiled with CUDA enabled"). "cpu" takes SGLang's own torch
    # pin_memory allocator (its npu/musa one), a plain host tensor here (above).
    try:
        import importlib.abc
        import importlib.machinery
        import sys

        import torch

        def _host_cache_without_cuda(module):
            module.ALLOC_MEMORY_FUNCS["cpu"] = module.alloc_with_pin_memory

        # SGLang freezes its processes' start-up heap out of the garbage collector once the
        # server is warm (http_server.py `_freeze_gc_after_server_warmup`, POST /freeze_gc to
        # itself). With --skip-server-warmup (CPU_FLAGS) that POST goes out before uvicorn
        # listens, is refused, and nothing is frozen; SGLang's CPU platform empties its
        # "cache" with a full gc.collect() (platforms/cpu.py empty_cache), which every
        # /release_memory_occupation and every weight update's flush_cache then pays on the
        # scheduler's whole heap: ~0.5 s of CPU each on the tiny model, ~10 ms frozen. The
        # freeze waits until the server answers (as SGLang's own warm-up wait does), in a
        # thread of its own: SGLang joins the warm-up thread when its app shuts down, so a
        # wait inside it would hold a server that never listens (its port taken: uvicorn
        # shuts the app down and exits 1) for the whole wait before it exits.
        def _freeze_once_listening(module):
            freeze = getattr(module, "_freeze_gc_after_server_warmup", None)
            if freeze is None:  # another SGLang: its own freeze, as it is
                return

            def freeze_when_up(server_args, *args, **kwargs):
                import threading
                import time

                import requests

                def wait_then_freeze():
                    deadline = time.monotonic() + 120
                    while time.monotonic() < deadline:
                        try:  # any answer: the port listens (its auth is the freeze's own)
                            requests.get(server_args.url() + "/model_info", timeout=5)
                            return freeze(server_args, *args, **kwargs)
                        except requests.exceptions.RequestException:
                            time.sleep(0.2)

                threading.Thread(target=wait_then_freeze, name="relax-freeze-gc",
                                 daemon=True).start()

            module._freeze_gc_after_server_warmup = freeze_when_up

        # SGLang starts its scheduler and detokenizer processes with multiprocessing's "spawn"
        # (entrypoints/engine.py `_set_envs_and_config`), which CUDA needs: a forked child
        # cannot use the parent's CUDA context. Each spawned child imports SGLang,
        # transformers and torch again before it does anything: ~20 of a tiny server's ~30
        # CPU-s of start (the detokenizer ~9 CPU-s of imports alone), ~27 s to /health on
        # 2 cores. Without CUDA there is nothing a fork would share wrongly, and the server's
        # process has one thread when it starts them (checked: threading.enumerate() at the
        # fork), so it forks them: ~11 CPU-s, ~15 s.
        def _fork_children(module):
            set_up = getattr(module, "_set_envs_and_config", None)
            if set_up is None:  # another SGLang: its own start method, as it is
                return

            def set_envs_and_config(*args, **kwargs):
                result = set_up(*args, **kwargs)
                import multiprocessing

                multiprocessing.set_start_method("fork", force=True)
                return result

            module._set_envs_and_config = set_envs_and_config

        _AFTER_IMPORT = ({} if torch.cuda.is_available() else
                         {"sglang.srt.mem_cache.pool_host.common": _host_cache_without_cuda,
                          "sglang.srt.entrypoints.http_server": _freeze_once_listening,
                          "sglang.srt.entrypoints.engine": _fork_children})

        class _PatchAfterImport(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                patch = _AFTER_IMPORT.get(name)
                spec = patch and importlib.machinery.PathFinder.find_spec(name, path, target)
                if not spec or spec.loader is None:
                    return None
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    patch(module)

                spec.loader.exec_module = exec_module
                return spec

        sys.meta_path.insert(0, _PatchAfterImport())
    except Exception:  # no torch yet
        pass
    # SGLang reads audio (utils/common.py load_audio, the soundfile fallback used without
    # torchcodec/FFmpeg) with `import torchaudio` before it knows whether it must resample
    # (common.py:1971; torchaudio.functional.resample only when the file's rate differs from the
    # processor's, common.py:1990). The venv leaves torchaudio out (PyPI's is a CUDA build), so
    # every audio request failed with HTTP 500 ("No module named 'torchaudio'"). Without a real
    # torchaudio a stand-in answers that import: reading a file already at the processor's rate
    # needs nothing of it; a resample raises, naming the fix (the rollout worker resamples by
    # linear interpolation, data/media.py, not torchaudio's sinc filter: convert offline).
    try:
        import importlib.abc
        import importlib.machinery
        import importlib.util
        import sys
        import types

        if importlib.util.find_spec("torchaudio") is None:
            def _resample(waveform, orig_freq, new_freq, *args, **kwargs):
                raise NotImplementedError(
                    f"audio at {orig_freq} Hz, the model's processor takes {new_freq} Hz: this "
                    "CPU SGLang venv has no torchaudio to resample with; convert the audio to "
                    f"{new_freq} Hz offline (relax_sglang_cpu_shim)")

            class _TorchaudioStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
                NAMES = ("torchaudio", "torchaudio.functional")

                def find_spec(self, name, path, target=None):
                    if name not in self.NAMES:
                        return None
                    return importlib.machinery.ModuleSpec(name, self,
                                                          is_package=name == "torchaudio")

                def create_module(self, spec):
                    return types.ModuleType(spec.name)

                def exec_module(self, module):
                    if module.__name__ == "torchaudio.functional":
                        module.resample = _resample
                    else:
                        module.__path__ = []
                        module.functional = importlib.import_module("torchaudio.functional")

            sys.meta_path.append(_TorchaudioStandIn())
    except Exception:
        pass
