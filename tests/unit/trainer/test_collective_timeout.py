"""The trainer group's collective timeout covers rank 0's longest stretch away from it: a batch
wait into which a restarted engine's re-sync falls (issue #34: with the 30B preset's 1200 s
engine start-up, ranks 1.. timed out at get_batch_timeout_s + 300 s with an anonymous gloo or
NCCL error while rank 0 still waited for the engine it would have named)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relax_slurm.launch.submit import compose_config
from relax_slurm.trainer.ranks import collective_timeout_s

GPU = ["cluster=slurm", "run_dir=/tmp/relax-unit-run", "rollout=sglang"]


@pytest.mark.parametrize("preset", ["tiny_cpu", "qwen3_4b_dapo", "qwen3_30b_a3b_dapo",
                                    "qwen3_vl_30b_a3b_openr1", "qwen3_omni_30b_a3b_avqa"])
def test_ranks_wait_longer_than_a_batch_wait_with_an_engine_restart_in_it(preset):
    overrides = [] if preset == "tiny_cpu" else GPU
    cfg = compose_config([f"experiment={preset}", *overrides])
    rank0_away = (cfg.trainer.get_batch_timeout_s + cfg.rollout.startup_timeout_s
                  + 2 * cfg.weight_sync.timeout_s)
    assert collective_timeout_s(cfg) > rank0_away


PROBE = """
import os, sys, torch, torch.distributed as dist
from relax_slurm.launch.submit import compose_config
from relax_slurm.trainer.ranks import init_distributed
cfg = compose_config(["experiment=tiny_cpu", "rollout.startup_timeout_s=1200"])
init_distributed(cfg)
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print(backend.options._timeout.total_seconds())
"""


def test_the_group_is_formed_with_that_timeout():
    from relax_slurm.runtime.ports import free_port

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=os.environ | env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = compose_config(["experiment=tiny_cpu", "rollout.startup_timeout_s=1200"])
    assert float(out.stdout.split()[-1]) == collective_timeout_s(cfg) > 1200 + 600
