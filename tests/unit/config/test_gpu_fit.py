"""On Slurm with GPUs, the trainer's ranks and the SGLang engines must fit the GPUs the job asks
for per node; a layout that does not is refused when the config is read, naming the keys, not
found on the nodes as an engine that never starts or two processes on one GPU."""

from __future__ import annotations

import pytest

from relax_slurm.errors import ConfigError
from relax_slurm.launch.submit import compose_config

GPU = ["cluster=slurm", "run_dir=/tmp/relax-unit-run", "rollout=sglang", "cluster.gpus_per_node=8"]


def cfg(*overrides: str):
    return compose_config(["experiment=tiny_cpu", *GPU, *overrides])


def test_a_preset_that_fits_composes():
    c = cfg("trainer.nproc_per_node=8", "rollout.num_engines=4", "rollout.engine_tp_size=2")
    assert c.rollout.num_engines == 4


def test_more_ranks_than_gpus_names_nproc_per_node():
    with pytest.raises(ConfigError, match=r"trainer\.nproc_per_node=9 .*cluster\.gpus_per_node=8"):
        cfg("trainer.nproc_per_node=9")


def test_engines_that_overflow_a_rollout_node_are_refused():
    # 5 engines round robin over 2 rollout nodes: 3 on the first, x TP 4 = 12 > 8
    with pytest.raises(ConfigError, match=r"3 engine\(s\) per node x rollout\.engine_tp_size=4"):
        cfg("rollout.num_engines=5", "rollout.engine_tp_size=4", "cluster.rollout_nodes=2")
    cfg("rollout.num_engines=4", "rollout.engine_tp_size=4", "cluster.rollout_nodes=2")
    # the rollout component's own GPU count, when it differs
    with pytest.raises(ConfigError, match="4 GPUs of a rollout node"):
        cfg("rollout.num_engines=2", "rollout.engine_tp_size=4", "cluster.rollout_gpus_per_node=4")


def test_shared_nodes_count_the_trainers_gpus_unless_engines_sleep():
    shared = ["cluster.layout=colocated", "cluster.rollout_nodes=0", "trainer.nproc_per_node=4"]
    cfg(*shared, "rollout.num_engines=4")  # GPUs 4-7
    with pytest.raises(ConfigError, match="after the trainer's 4 .*trainer node"):
        cfg(*shared, "rollout.num_engines=5")
    # shared GPUs: engines start at GPU 0 and sleep while the trainer steps
    cfg(*shared, "rollout.num_engines=8", "rollout.release_memory_during_train=true")


def test_cpu_jobs_and_the_hf_engine_are_not_counted():
    cfg("cluster.gpus_per_node=0", "rollout.num_engines=64")
    compose_config(["experiment=tiny_cpu", "cluster=slurm", "run_dir=/tmp/relax-unit-run",
                    "cluster.gpus_per_node=2", "rollout.num_engines=4"])


def test_the_generate_timeout_grows_with_the_answer_length():
    # the 30B preset's 8192-token answers in full batches outlived a fixed 300 s, and the
    # group's retry with the same seeds timed out again
    long = compose_config(["experiment=qwen3_30b_a3b_dapo", "run_dir=/tmp/relax-unit-run"])
    assert long.rollout.request_timeout_s is None
    assert long.rollout.generate_timeout_s == 300 + 0.1 * 8192
    tiny = compose_config(["experiment=tiny_cpu", "run_dir=/tmp/relax-unit-run",
                           "rollout.request_timeout_s=42"])
    assert tiny.rollout.generate_timeout_s == 42
