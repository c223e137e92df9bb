"""python ckpt_kill_during_save.py --root R --stage STAGE --marker M

Saves checkpoint step 1 completely, then starts saving step 2 and stops dead at STAGE, where it
touches M and sleeps until the test SIGKILLs it:

    write         DCP has written this rank's shard file, .metadata and meta.json not yet
    before_rename everything is in step_2.tmp/ (meta.json too), the rename has not happened
    after_rename  step_2/ is in place, the `latest` pointer still names step_1

Before each save it writes that step's weights to R/../ref_step<N>.safetensors. The model is a
small torch MLP (`build_model`): the commit protocol does not depend on the model, and a process
without transformers starts much faster.
"""

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter

import relax_slurm.checkpoint.dcp as ckpt


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def stall(marker: Path):
    def hook(*args, **kwargs):
        marker.write_text("stalled\n")
        time.sleep(600)  # the test kills us here
    return hook


def install(stage: str, marker: Path) -> None:
    if stage == "write":
        original = FileSystemWriter.write_data

        def write_then_stall(self, plan, planner):
            fut = original(self, plan, planner)
            fut.wait()
            stall(marker)()
            return fut
        FileSystemWriter.write_data = write_then_stall
    elif stage == "before_rename":
        ckpt._replace_dir = stall(marker)
    elif stage == "after_rename":
        ckpt._write_latest = stall(marker)
    else:
        raise SystemExit(f"unknown stage {stage}")


def train_and_save(model, opt, root: Path, step: int) -> ckpt.SaveHandle:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    save_file(weights, str(root.parent / f"ref_step{step}.safetensors"))
    return ckpt.save_checkpoint(root, step, model, opt, None, {"version": step}, keep_last=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, type=Path)
    ap.add_argument("--stage", required=True)
    ap.add_argument("--marker", required=True, type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_and_save(model, opt, args.root, 1).wait()
    install(args.stage, args.marker)
    train_and_save(model, opt, args.root, 2).wait()
    raise SystemExit("the save of step 2 finished although it should have stalled")


if __name__ == "__main__":
    main()
