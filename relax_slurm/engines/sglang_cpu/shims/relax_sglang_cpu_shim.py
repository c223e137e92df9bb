"""Loaded at interpreter start in the CPU SGLang venv (by relax_sglang_cpu_shim.pth), only when
SGLANG_USE_CPU_ENGINE=1, i.e. in the server and its scheduler and detokenizer processes.

torchvision 0.28.0 from PyPI is a CUDA build: its _C.so cannot load against the CPU torch, so
the torchvision::nms and ::qnms operators are never defined and `import torchvision` dies in
torchvision/_meta_registrations.py (register_fake("torchvision::nms")). SGLang imports
torchvision.transforms while it imports its model configs. Defining the two operators' schemas
(no kernels) lets those registrations succeed; nothing on the text path calls nms.
"""

import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    try:
        import torch

        _TORCHVISION = torch.library.Library("torchvision", "FRAGMENT")
        _TORCHVISION.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TORCHVISION.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # already defined (a working torchvision), or no torch yet
        pass
