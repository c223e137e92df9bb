"""The checks across sections of a run's config, each named after what it guards and given
only the sections it reads; `TrainConfig.__post_init__` runs them in order. Each refuses with
the override that fixes it (ConfigError, through `check`)."""

from __future__ import annotations

from relax_slurm.config.algo import BATCH_WIDE_ADVANTAGE_ALGOS, AlgoConfig
from relax_slurm.config.check import check
from relax_slurm.config.cluster import ClusterConfig, SlurmClusterConfig
from relax_slurm.config.data import DataConfig
from relax_slurm.config.env import EnvConfig
from relax_slurm.config.model import SGLANG_LORA_TARGETS, ModelConfig
from relax_slurm.config.reward import RewardConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.trainer import TrainerConfig
from relax_slurm.config.weight_sync import WeightSyncConfig, engines_on_trainer_host

SEED_LIMIT = 1 << 22
"""seed below this: its sampling seeds (seed << 40, plus up to 2**40 samples) stay in int64."""


def check_seed(seed: int) -> None:
    # every sampling_seed is (seed << 40) + group * n + index (rollout/sampling.py
    # sample_seed), and SGLang refuses seeds outside int64
    check(0 <= seed < SEED_LIMIT,
          f"seed={seed}: must be in [0, {SEED_LIMIT}) (it is shifted 40 bits into "
          "every sampling_seed, which engines take as a signed 64-bit integer)")


def check_overlong_buffer(algo: AlgoConfig, rollout: RolloutConfig) -> None:
    buffer, max_new = algo.overlong_buffer_tokens, rollout.max_new_tokens
    check(buffer == 0 or buffer < max_new,
          f"algo.overlong_buffer_tokens={buffer} must be below rollout.max_new_tokens="
          f"{max_new} (the penalty ramps up over the last buffer tokens before the limit): "
          "lower algo.overlong_buffer_tokens (about a fifth of max_new_tokens) or set it to 0")


def check_rollout_mode(algo: AlgoConfig, rollout: RolloutConfig, env: EnvConfig) -> None:
    """The worker's mode (env or proxy) and the colocated engines' sleep."""
    check(rollout.agent_mode == "env" or not env.name,
          "rollout.agent_mode=proxy: external agents play the environment's part; unset "
          "env.name (env=none), or use rollout.agent_mode=env")
    # shared GPUs: engines hold no memory while the trainer steps, so nothing may generate
    # then; only the on-policy schedule (rollout, then train) guarantees that
    check(not rollout.release_memory_during_train or algo.max_staleness == 0,
          f"rollout.release_memory_during_train=true needs algo.max_staleness=0 (engines "
          f"are asleep while the trainer steps; got {algo.max_staleness})")


def check_weight_sync_backend(ws: WeightSyncConfig, rollout: RolloutConfig) -> None:
    # the hf engine holds its weights on the CPU (the launcher starts it without --device), and
    # an NCCL group needs a CUDA tensor on every rank: its receive fails at once (first GPU run)
    check(ws.backend != "nccl" or rollout.engine != "hf",
          "weight_sync.backend=nccl with rollout.engine=hf: the hf engine receives on the CPU, "
          "which NCCL cannot reach; use weight_sync.backend=auto (gloo for the hf engine) or "
          "rollout=sglang")


def check_weight_transport(ws: WeightSyncConfig, rollout: RolloutConfig,
                           cluster: ClusterConfig) -> None:
    """Tensors by reference reach engines on rank 0's node only; engines sharing the GPUs of
    several trainer nodes have no transport (NCCL refuses two ranks on one GPU)."""
    check(ws.transport != "tensor" or engines_on_trainer_host(cluster),
          "weight_sync.transport=tensor hands tensors to engines by reference (CUDA IPC, "
          "shared memory), which reaches engines on trainer rank 0's node only: use "
          "cluster.layout=colocated with cluster.trainer_nodes=1 and cluster.rollout_nodes=0, "
          "or weight_sync.transport=distributed")
    on_gpus = (isinstance(cluster, SlurmClusterConfig) and cluster.gpus_per_node > 0
               and rollout.engine == "sglang" and rollout.engine_device != "cpu")
    shares_several = (on_gpus and rollout.release_memory_during_train
                      and cluster.layout == "colocated" and cluster.rollout_nodes == 0
                      and cluster.trainer_nodes > 1)
    check(not shares_several,
          f"rollout.release_memory_during_train=true on {getattr(cluster, 'trainer_nodes', 1)} "
          "shared trainer nodes: the engines of rank 0's node share its GPUs, where NCCL "
          "refuses a weight-update group (two ranks on one GPU), and tensors by reference do "
          "not reach the other nodes' engines. Use cluster.trainer_nodes=1, or engines on GPUs "
          "of their own (rollout.release_memory_during_train=false, or cluster.rollout_nodes>0)")


def check_weight_checks(rollout: RolloutConfig, ws: WeightSyncConfig) -> None:
    """weight_sync.verify reads /weights_checksum, which only the hf engine serves (SGLang
    answers 404, which would end the run after its first push)."""
    check(not (ws.verify and rollout.engine == "sglang"),
          "weight_sync.verify=true compares the engines' /weights_checksum, a route of the hf "
          "engine that SGLang does not serve: set weight_sync.verify=false with "
          "rollout.engine=sglang (or verify on rollout.engine=hf)")


def check_parallel_layout(t: TrainerConfig, cluster: ClusterConfig) -> None:
    """The trainer's ranks split into TP x PP x CP, and expert parallelism divides the rest."""
    world = t.nproc_per_node * cluster.trainer_node_count()  # cluster.trainer_nodes on Slurm
    model_parallel = t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size
    check(world % model_parallel == 0,
          f"{world} trainer ranks (trainer.nproc_per_node x cluster.trainer_nodes) do not "
          f"split into trainer.tensor_parallel_size={t.tensor_parallel_size} x "
          f"pipeline_parallel_size={t.pipeline_parallel_size} x context_parallel_size="
          f"{t.context_parallel_size}: change trainer.nproc_per_node or the parallel sizes")
    data_parallel = world // model_parallel
    check(data_parallel % t.expert_parallel_size == 0,
          f"trainer.expert_parallel_size={t.expert_parallel_size} must divide the data-"
          f"parallel size {data_parallel} (ranks / (TP x PP x CP)): change it or "
          "trainer.nproc_per_node")


def check_gpus_fit(t: TrainerConfig, rollout: RolloutConfig, cluster: ClusterConfig,
                   engines: int) -> None:
    """On Slurm with GPUs, every trainer rank and every SGLang engine (`engines` of them: the
    policy's, the teacher, the judge; rollout.engine_tp_size GPUs each, placed round robin
    over the rollout nodes, launch/roles.py base_gpu_id) has GPUs of its own on its node."""
    if not isinstance(cluster, SlurmClusterConfig) or cluster.gpus_per_node == 0:
        return
    check(t.nproc_per_node <= cluster.gpus_per_node,
          f"trainer.nproc_per_node={t.nproc_per_node} ranks per node, but "
          f"cluster.gpus_per_node={cluster.gpus_per_node}: each rank needs a GPU of its own; "
          "lower trainer.nproc_per_node or raise cluster.gpus_per_node")
    if rollout.engine != "sglang" or rollout.engine_device == "cpu":
        return
    shares = cluster.layout == "colocated" and cluster.rollout_nodes == 0
    nodes = cluster.trainer_nodes if shares else cluster.rollout_nodes
    per_node = -(-engines // nodes) * rollout.engine_tp_size
    gpus = (cluster.gpus_per_node if shares or cluster.rollout_gpus_per_node is None
            else cluster.rollout_gpus_per_node)
    # separate pools on shared nodes: engines start after the trainer's GPUs
    taken = t.nproc_per_node if shares and not rollout.release_memory_during_train else 0
    check(taken + per_node <= gpus,
          f"{-(-engines // nodes)} engine(s) per node x rollout.engine_tp_size="
          f"{rollout.engine_tp_size} GPUs" + (f" after the trainer's {taken}" if taken else "")
          + f" do not fit the {gpus} GPUs of a "
          + ("trainer node (cluster.rollout_nodes=0)" if shares else "rollout node")
          + ": lower rollout.num_engines or rollout.engine_tp_size, add nodes "
          "(cluster.rollout_nodes), or raise cluster.rollout_gpus_per_node")


def check_megatron_media(t: TrainerConfig, data: DataConfig) -> None:
    # the megatron backend trains Qwen2.5-VL, Qwen3-VL(-MoE) (images, video) and Qwen3-Omni's
    # thinker (images, video, audio), TP/EP only; whether the model takes the run's media
    # (audio: Qwen3-Omni only) is checked when it loads, its architecture known
    # (trainer/megatron/vl.py: kind, check_media)
    check(t.backend != "megatron" or not data.multimodal_keys
          or (t.pipeline_parallel_size == 1 and t.context_parallel_size == 1),
          "trainer=megatron with data.multimodal_keys supports tensor parallelism only: set "
          "trainer.pipeline_parallel_size=1 and trainer.context_parallel_size=1 "
          "(docs/backends.md#multimodal-models)")


def check_routing_replay(algo: AlgoConfig, rollout: RolloutConfig, t: TrainerConfig) -> None:
    check(not algo.routing_replay or rollout.return_routed_experts,
          "algo.routing_replay=true replays the experts the engines report: set "
          "rollout.return_routed_experts=true")
    # megatron's routers under context parallelism see each CP rank's chunks of the sequence:
    # trainer/megatron/routing.py maps them, but CP runs only with transformer-engine on GPUs
    # and that replay is untested there. (Sequence parallelism, an MoE model at TP > 1, is
    # mapped and tested.)
    check(not algo.routing_replay or t.context_parallel_size == 1,
          "algo.routing_replay=true with trainer.context_parallel_size > 1 is not supported "
          "yet: its replay across context-parallel ranks is untested. Fix: "
          "trainer.context_parallel_size=1 (tensor and expert parallelism replay) "
          "or algo.routing_replay=false (docs/algorithms.md#routing-replay)")


def check_mini_batches(t: TrainerConfig, rollout: RolloutConfig) -> None:
    steps = t.num_steps_per_rollout
    samples = rollout.batch_size * rollout.n_samples_per_prompt
    check(samples % steps == 0,
          f"trainer.num_steps_per_rollout={steps} must divide the batch's "
          f"rollout.batch_size x rollout.n_samples_per_prompt = {samples} samples (equal "
          "mini-batches): change one of them")


def check_batch_divides(rollout: RolloutConfig, t: TrainerConfig, data: int,
                        ranks: str = "") -> None:
    """A step's samples split evenly over `data` data-parallel ranks, into
    trainer.num_steps_per_rollout equal mini-batches on each. The trainer checks it with the
    ranks its backend reports (trainer/main.py); `ranks` says where the count comes from."""
    samples, steps = rollout.batch_size * rollout.n_samples_per_prompt, t.num_steps_per_rollout
    check(samples % (data * steps) == 0,
          f"rollout.batch_size x rollout.n_samples_per_prompt = {samples} samples per step do "
          f"not split evenly over {data} data-parallel trainer ranks"
          + (f" ({ranks})" if ranks else "")
          + (f" into trainer.num_steps_per_rollout={steps} equal mini-batches each" if steps > 1
             else "")
          + f": make rollout.batch_size x rollout.n_samples_per_prompt a multiple of "
          f"{data * steps}, or change trainer.nproc_per_node")


def check_data_parallel_batch(t: TrainerConfig, rollout: RolloutConfig,
                              cluster: ClusterConfig) -> None:
    """`check_batch_divides` on the ranks the config asks for, run by the launchers before any
    role starts (launch/inputs.py check_inputs): a run that broke it used to start every role
    and then fail in the trainer."""
    world = t.nproc_per_node * cluster.trainer_node_count()
    data = world // (t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size)
    check_batch_divides(rollout, t, data,
                        "trainer.nproc_per_node x cluster.trainer_nodes" if data == world else
                        "trainer ranks / (TP x PP x CP)")


def check_critic_backend(algo: AlgoConfig, t: TrainerConfig) -> None:
    """The megatron critic runs under TP, DP and EP; its values would exist on the last
    pipeline stage only, and under CP in sequence chunks (trainer/megatron/critic.py)."""
    if t.backend != "megatron" or not algo.uses_critic:
        return
    for key, size in (("pipeline_parallel_size", t.pipeline_parallel_size),
                      ("context_parallel_size", t.context_parallel_size)):
        check(size == 1,
              f"algo={algo.name} with trainer=megatron and trainer.{key}={size}: the megatron "
              "critic runs under tensor, data and expert parallelism only; set "
              f"trainer.{key}=1 (docs/algorithms.md#ppo-with-a-critic)")


def check_judge(r: RewardConfig) -> None:
    # (the run plan fills genrm_url in for a managed judge: runtime/plan.py)
    check(not (r.genrm_url and r.genrm_model_path),
          f"reward.genrm_url={r.genrm_url} and reward.genrm_model_path="
          f"{r.genrm_model_path} are both set: set genrm_url for a judge you run, or "
          "genrm_model_path for one relax-train serves, not both")


def streaming_blockers(algo: AlgoConfig, t: TrainerConfig) -> list[str]:
    """Why this run cannot train on groups as they arrive (empty: it can)."""
    out = []
    if algo.max_staleness < 1:
        out.append("algo.max_staleness=0 (on-policy: the whole batch is generated with one "
                   "version and sync runs stay bitwise reproducible)")
    if t.backend != "torch":
        out.append(f"trainer.backend={t.backend} (megatron's schedule reduces "
                   "gradients at the end of every forward_backward call and needs the "
                   "micro-batch count up front)")
    if algo.name in BATCH_WIDE_ADVANTAGE_ALGOS:
        out.append(f"algo={algo.name} (its advantages use the whole batch's rewards)")
    if algo.uses_critic:
        out.append(f"algo={algo.name} (its GAE advantages are whitened over the whole "
                   "batch's tokens, from the critic's values before its update)")
    if t.num_steps_per_rollout > 1:
        out.append(f"trainer.num_steps_per_rollout={t.num_steps_per_rollout} "
                   "(the old log-probs of the whole batch are taken before its first "
                   "optimizer step)")
    if algo.loss_reduction == "token_mean":
        out.append("algo.loss_reduction=token_mean (its weights divide by the whole batch's "
                   "token count)")
    return out


def check_streaming(algo: AlgoConfig, t: TrainerConfig) -> None:
    blockers = streaming_blockers(algo, t)
    check(not (t.streaming and blockers),
          "trainer.streaming=true does not apply to this run: " + "; ".join(blockers)
          + ". Set trainer.streaming=null (streams where it applies) or false")


def supervised_problems(algo: AlgoConfig, rollout: RolloutConfig, data: DataConfig,
                        trainer: TrainerConfig) -> list[str]:
    """What an SFT run's config gets wrong (empty: nothing). Its loss goes through the shared
    policy_loss with the rows' log-probs standing in for an engine's (there is none), so the
    knobs that read those must be off."""
    out = []
    if algo.tis_clip is not None or algo.opsm_delta is not None:
        out.append("algo=sft has no rollout log-probs to correct against: set "
                   "algo.tis_clip=null and algo.opsm_delta=null")
    if algo.old_logprobs == "rollout" or algo.max_staleness:
        out.append("algo=sft trains on a dataset, not on rollouts: set "
                   "algo.old_logprobs=auto and algo.max_staleness=0")
    if rollout.temperature != 1.0:
        out.append(f"algo=sft's NLL is of the model's own distribution, but "
                   f"rollout.temperature={rollout.temperature} scales the trainer's "
                   "logits: set rollout.temperature=1.0")
    if data.multimodal_keys:
        out.append("algo=sft reads text rows only (multimodal SFT is not implemented): "
                   "unset data.multimodal_keys")
    if trainer.stop_at.reward is not None:
        out.append("algo=sft has no rollout reward for trainer.stop_at.reward="
                   f"{trainer.stop_at.reward} to reach: unset it (trainer.stop_at.reward=null)")
    return out


def adapter_sync_blockers(model: ModelConfig, rollout: RolloutConfig) -> list[str]:
    """Why the engines cannot serve model.lora's adapter (empty: they can, and each sync sends
    the adapter alone); the sync then sends merged weights (docs/lora.md)."""
    lora = model.lora
    if not lora.enabled:
        return ["model.lora.rank=0 (LoRA is off)"]
    if lora.sync == "merged":
        return ["model.lora.sync=merged"]
    unserved = [m for m in lora.target_modules if m not in SGLANG_LORA_TARGETS]
    if rollout.engine == "sglang" and unserved:
        return [f"SGLang serves no adapter on {unserved} (model.lora.target_modules)"]
    return []


def check_lora(model: ModelConfig, algo: AlgoConfig, t: TrainerConfig, rollout: RolloutConfig,
               ws: WeightSyncConfig) -> None:
    """What LoRA training does not combine with (docs/lora.md#status)."""
    lora = model.lora
    if not lora.enabled:
        return
    if t.backend == "megatron":
        # megatron-bridge's LoRA (trainer/megatron/lora.py), tested with tensor, data,
        # pipeline and expert parallelism and the distributed optimizer; context parallelism
        # is refused until it is
        check(t.context_parallel_size == 1,
              f"model.lora with trainer=megatron and trainer.context_parallel_size="
              f"{t.context_parallel_size} is not tested yet (docs/lora.md#status): set it to 1 "
              "(tensor, data, pipeline and expert parallelism are supported), or use "
              "trainer=torch")
        # expert parallelism means an MoE model, whose MLP targets are its routed experts:
        # adapters there are refused (lora.py check_no_expert_targets says why); the model's
        # own config is read at start for the same check at any EP
        experts = [m for m in lora.target_modules if m in ("gate_proj", "up_proj", "down_proj")]
        check(t.expert_parallel_size == 1 or not experts,
              f"model.lora.target_modules has {experts}, which with trainer.expert_parallel_"
              f"size={t.expert_parallel_size} (an MoE model) are its routed experts: "
              "trainer=megatron does not adapt MoE experts (docs/lora.md). Fix: "
              "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj] (add lm_head if "
              "wanted): the experts stay frozen")
        # the HF modules megatron adapts (trainer/megatron/lora.py HF_TO_CANONICAL)
        served = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "lm_head")
        unknown = [m for m in lora.target_modules if m not in served]
        check(not unknown,
              f"model.lora.target_modules has {unknown}, which trainer=megatron cannot adapt "
              f"(megatron-bridge's LoRA goes on {list(served)}): drop them, or use "
              "trainer=torch")
        check(lora.rank % t.tensor_parallel_size == 0,
              f"model.lora.rank={lora.rank} does not split over trainer.tensor_parallel_size="
              f"{t.tensor_parallel_size} (megatron-bridge shards each q/k/v/gate/up adapter's "
              "A along its rank): choose a rank that tensor_parallel_size divides")
    check(algo.ref_update_interval is None,
          f"algo.ref_update_interval={algo.ref_update_interval} with model.lora: the reference "
          "is model.path itself (the policy with its adapter disabled), which never moves; "
          "unset algo.ref_update_interval, or model.lora.rank=0")
    check(not t.freeze_modules,
          "trainer.freeze_modules with model.lora: every base weight is frozen already (only "
          "the adapters train); unset trainer.freeze_modules")
    blockers = adapter_sync_blockers(model, rollout)
    check(lora.sync != "adapter" or not blockers,
          f"model.lora.sync=adapter, but {'; '.join(blockers)}: use model.lora.sync=auto "
          "(merged weights then) or change the targets")
    if blockers:
        return
    check(not ws.verify,
          "weight_sync.verify=true compares full weights; with an adapter-only sync the "
          "engines hold the adapter beside model.path: set weight_sync.verify=false, or "
          "model.lora.sync=merged")
