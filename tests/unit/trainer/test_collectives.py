"""The trainer's collectives never get a tensor built without a device.

NCCL reduces only CUDA tensors, gloo takes CPU ones too: the first GPU run crashed in step 1 on
`dist.all_reduce(torch.tensor([...]))` of metric sums (trainer/step.py), then on the control
request's broadcast (trainer/ranks.py), and SFT's validation had the same line; no CPU run
could see it. The tensors the trainer builds from host values go through
`trainer/collectives.py` (on the rank's device); this reads every other trainer file and
refuses a collective whose tensor comes from a torch factory call without `device=`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TRAINER = Path(__file__).resolve().parents[3] / "relax_slurm" / "trainer"
COLLECTIVES = {"all_reduce", "broadcast", "scatter", "gather", "all_gather", "reduce",
               "reduce_scatter", "all_to_all", "all_gather_into_tensor",
               "reduce_scatter_tensor", "send", "recv", "isend", "irecv"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "rand", "randn"}


def _deviceless_factory(node: ast.AST) -> bool:
    """`torch.tensor(...)` and the like, without a device= keyword."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and node.func.attr in FACTORIES
            and not any(k.arg == "device" for k in node.keywords))


def deviceless_collectives(source: str, filename: str) -> list[str]:
    """`file:line` of each collective whose tensor argument is a device-less factory call, or a
    name that its function assigns from one."""
    found = []
    tree = ast.parse(source, filename)
    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        made = {t.id for n in ast.walk(func) if isinstance(n, ast.Assign)
                and _deviceless_factory(n.value) for t in n.targets if isinstance(t, ast.Name)}
        for call in ast.walk(func):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "dist"
                    and call.func.attr in COLLECTIVES and call.args):
                continue
            arg = call.args[0]
            if _deviceless_factory(arg) or (isinstance(arg, ast.Name) and arg.id in made):
                found.append(f"{filename}:{call.lineno}")
    return sorted(set(found))


def test_no_trainer_collective_takes_a_tensor_without_a_device():
    bad = []
    for path in sorted(TRAINER.rglob("*.py")):
        if path.name != "collectives.py":
            bad += deviceless_collectives(path.read_text(), str(path.relative_to(TRAINER)))
    assert not bad, ("a collective on a tensor built without device= (NCCL refuses CPU "
                     f"tensors): use relax_slurm.trainer.collectives: {bad}")


def test_the_check_finds_the_lines_the_gpu_run_crashed_on():
    # trainer/step.py and trainer/ranks.py as they were at f28b6ee
    step = ("def reduce_metrics(sums):\n    keys = sorted(sums)\n"
            "    totals = torch.tensor([sums[k] for k in keys], dtype=torch.float64)\n"
            "    dist.all_reduce(totals)\n")
    ranks = ("def broadcast_request(request):\n    t = torch.tensor([REQUESTS.index(request)])\n"
             "    dist.broadcast(t, src=0)\n")
    assert deviceless_collectives(step, "step.py") == ["step.py:4"]
    assert deviceless_collectives(ranks, "ranks.py") == ["ranks.py:3"]
    fine = ("def f(device):\n    t = torch.zeros(3, device=device)\n    dist.broadcast(t, src=0)\n")
    assert deviceless_collectives(fine, "f.py") == []


def _ranks(rank: int, store: str, out: str) -> None:
    from relax_slurm.trainer import collectives

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        collectives.use_device(torch.device("cpu"))
        # numbers and scalar device tensors side by side, as reduce_metrics passes them
        total = collectives.all_reduce_sum([1.5 + rank, torch.tensor(2.0 * rank), 3])
        request = collectives.broadcast_int(7 if rank == 0 else -1)
        torch.save({"total": total, "request": request}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_sums_and_broadcasts_over_two_real_ranks(tmp_path):
    mp.spawn(_ranks, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}")
        assert got == {"total": [4.0, 2.0, 6.0], "request": 7}


def _nccl_rank(rank: int, store: str, out: str) -> None:
    from relax_slurm.trainer import collectives

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=1)
    try:
        collectives.use_device(torch.device("cuda", 0))
        total = collectives.all_reduce_sum([1.5, torch.tensor(2.0, device="cuda"), 3])
        torch.save({"total": total, "request": collectives.broadcast_int(7)}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_helpers_run_on_nccl(tmp_path):
    # what the first GPU run failed on: a collective of host values on the NCCL group
    mp.spawn(_nccl_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=1,
             join=True)
    assert torch.load(tmp_path / "out") == {"total": [1.5, 2.0, 3.0], "request": 7}
