"""torchrun --nproc-per-node 1 megatron_kill_async_save.py --model-dir D --root R

The megatron backend's async save, crashed: saves step 1 synchronously, starts an async save of
step 2 (a forked writer holds the state) and SIGKILLs itself before the save is finalized, as a
node failure would. The test then checks that step 2 never looks like a checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from relax_slurm.config.model import ModelConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.trainer.megatron import checkpoint
from relax_slurm.trainer.megatron.model import MegatronModel, init_model_parallel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--root", required=True, type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    cfg = TrainerConfig(backend="megatron", nproc_per_node=1)
    init_model_parallel(cfg)
    mm = MegatronModel(ModelConfig(path=args.model_dir), cfg)
    checkpoint.save(args.root, 1, mm, {"marker": 1}, keep_last=3, hf_assets_src=args.model_dir)
    checkpoint.save(args.root, 2, mm, {"marker": 2}, keep_last=3, hf_assets_src=args.model_dir,
                    async_save=True)
    # torchrun starts each rank in a session of its own: the forked writer stays in the
    # rank's, which the test kills once the rank is gone (the writer would outlive it)
    (args.root.parent / "scheduled").write_text(f"{os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
