"""The run's config, `TrainConfig`: one section per Hydra group, each typed by a dataclass in
its own module (config/model.py, algo.py, rollout.py, trainer.py, data.py, reward.py,
weight_sync.py, broker.py, cluster.py, reporting.py, evaluation.py, env.py, sft.py).

YAML files under `conf/` fill these in; Hydra rejects unknown keys and wrong types because the
root is a structured config. Each section checks its own fields in its `__post_init__`; the
checks across sections (config/py) run in `TrainConfig.__post_init__`. Both name
the override that fixes them and run when `load_config` turns the merged config into these
objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from relax_slurm.config.algo import SUPERVISED_ALGOS, AlgoConfig
from relax_slurm.config.broker import BrokerConfig
from relax_slurm.config.check import check
from relax_slurm.config.cluster import ClusterConfig, LocalClusterConfig
from relax_slurm.config.cross_checks import (
    adapter_sync_blockers,
    check_critic_backend,
    check_gpus_fit,
    check_judge,
    check_lora,
    check_megatron_media,
    check_mini_batches,
    check_overlong_buffer,
    check_parallel_layout,
    check_rollout_mode,
    check_routing_replay,
    check_seed,
    check_streaming,
    check_weight_sync_backend,
    check_weight_checks,
    check_weight_transport,
    streaming_blockers,
    supervised_problems,
)
from relax_slurm.config.data import DataConfig
from relax_slurm.config.env import EnvConfig
from relax_slurm.config.evaluation import EvalConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.reporting import DebugConfig, MetricsConfig, NotifyConfig
from relax_slurm.config.reward import RewardConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.sft import SFTConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.config.weight_sync import WeightSyncConfig


@dataclass(kw_only=True)
class TrainConfig:
    run_dir: str = MISSING
    """Directory of this run: config.yaml, metrics.jsonl, logs/, checkpoints/."""
    seed: int = 0
    resume: str = "auto"
    """auto: resume from the latest complete checkpoint in run_dir if any; none: start fresh
    (refused if run_dir has checkpoints, unless overwrite=true); or a checkpoint path."""
    overwrite: bool = False
    """With resume=none, allow starting over in a run_dir that has checkpoints."""
    resume_with_changes: bool = False
    """Allow a resume whose config differs from the one its checkpoint's steps ran with (in
    keys that change what a step computes; see launch/rerun.py); recorded in
    run_dir/config_history.jsonl."""
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    cluster: ClusterConfig = field(default_factory=LocalClusterConfig)
    """Where the roles run: a LocalClusterConfig or a SlurmClusterConfig (cluster=local|slurm)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def __post_init__(self) -> None:
        check_seed(self.seed)
        check_overlong_buffer(self.algo, self.rollout)
        check_rollout_mode(self.algo, self.rollout, self.env)
        check_weight_checks(self.rollout, self.weight_sync)
        check_parallel_layout(self.trainer, self.cluster)
        check_gpus_fit(self.trainer, self.rollout, self.cluster,
                       self.rollout.num_engines + bool(self.algo.teacher_model_path)
                       + bool(self.reward.genrm_model_path))
        check_megatron_media(self.trainer, self.data)
        check_routing_replay(self.algo, self.rollout, self.trainer)
        check_mini_batches(self.trainer, self.rollout)
        check_critic_backend(self.algo, self.trainer)
        check_judge(self.reward)
        check_streaming(self.algo, self.trainer)
        check_weight_sync_backend(self.weight_sync, self.rollout)
        check_weight_transport(self.weight_sync, self.rollout, self.cluster)
        check_lora(self.model, self.algo, self.trainer, self.rollout, self.weight_sync)
        problems = self.supervised_problems()
        check(not problems, "; ".join(problems))

    def streaming_blockers(self) -> list[str]:
        """Why this run cannot train on groups as they arrive (empty: it can)."""
        return streaming_blockers(self.algo, self.trainer)

    @property
    def adapter_sync(self) -> bool:
        """Whether each weight sync sends model.lora's adapter alone (docs/lora.md)."""
        return not adapter_sync_blockers(self.model, self.rollout)

    @property
    def supervised(self) -> bool:
        """An SFT run: the trainer alone, on a dataset's targets (trainer/sft.py)."""
        return self.algo.name in SUPERVISED_ALGOS

    def supervised_problems(self) -> list[str]:
        """What an SFT run's config gets wrong (empty: nothing, or not an SFT run)."""
        if not self.supervised:
            return []
        return supervised_problems(self.algo, self.rollout, self.data, self.trainer)

    @property
    def streams(self) -> bool:
        """Whether the trainer takes a step's groups as they arrive (trainer.streaming)."""
        return self.trainer.streaming is not False and not self.streaming_blockers()
