"""`rollout`: engines, sampling, the worker's admission and the agent proxy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from relax_slurm.config.check import check

BASE_GENERATE_TIMEOUT_S = 300.0
GENERATE_S_PER_TOKEN = 0.1
"""rollout.request_timeout_s=null: 300 s + 0.1 s per rollout.max_new_tokens."""

@dataclass(kw_only=True)
class RolloutConfig:
    engine: str = "hf"
    """Engine backend: hf (transformers server of ours, CPU) or sglang (GPU)."""
    num_engines: int = 1
    """Engine servers to start; each joins the weight-sync group."""
    batch_size: int = 16
    """Prompt groups per training step (rollout_batch_size)."""
    n_samples_per_prompt: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    max_inflight_groups: int = 64
    """Groups the worker generates concurrently (bounded further by admission control)."""
    groups_per_request: int = 1
    """Groups admitted together go to an engine in one batched /generate of at most this many
    groups (fewer HTTP round trips and bigger hf-engine batches; a batch returns when its
    slowest sequence ends, so keep 1 for long, uneven GPU generations)."""
    engine_max_batch_size: int = 1024
    """hf engine: sequences batched into one generate call."""
    engine_batch_wait_ms: float = 5.0
    """hf engine: how long to wait for more requests before starting a batch."""
    request_timeout_s: Optional[float] = None
    """Timeout of one /generate call (an engine answers when its longest sequence ends);
    null: derived from rollout.max_new_tokens (`generate_timeout_s`). A fixed 300 s timed out
    8192-token answers in full batches, and the group's retry (same seeds) timed out again."""
    startup_timeout_s: float = 300.0
    """How long to wait for an engine's /health after starting it."""
    torch_threads: int = 1
    """Intra-op threads of each engine process."""
    engine_tp_size: int = 1
    """sglang: GPUs per engine (--tp-size); the engine joins the weight sync as ranks
    rank_offset .. rank_offset + engine_tp_size - 1."""
    engine_ep_size: int = 1
    """sglang: expert parallel size inside an engine (--ep-size, MoE models; divides tp)."""
    engine_mem_fraction: float = 0.8
    """sglang: --mem-fraction-static, the GPU memory share for weights and KV cache."""
    engine_api_key: bool = True
    """sglang: servers require a key (--api-key): RELAX_ENGINE_API_KEY from the launcher's
    environment, else the run's secret (never in the config or a command line); every client
    sends it. hf engines require the same key whenever that variable is set."""
    engine_extra_args: list[str] = field(default_factory=list)
    """sglang: more `python -m sglang.launch_server` flags, passed as they are (not
    --pp-size or --dp-size > 1: the weight-sync ranks assume one TP group per engine; refused
    with rollout.engine=hf, which takes none)."""
    engine_python: Optional[str] = None
    """sglang: the python that runs `-m sglang.launch_server` (SGLang in an env or container of
    its own). null: the launcher's python, or with engine_device=cpu the project's CPU SGLang
    venv, built on first use (`relax-sglang-cpu install`; docs/engines.md#sglang-on-cpu)."""
    engine_device: str = "auto"
    """sglang: cuda, cpu (SGLang's CPU engine: SGLANG_USE_CPU_ENGINE=1 and its CPU flags, for
    tests and machines without GPUs) or auto (cpu for a local run on a machine without a GPU,
    cuda otherwise)."""
    release_memory_during_train: bool = False
    """Colocated placement: engines release GPU memory (/release_memory_occupation) while the
    trainer steps and resume it for rollout; sglang engines then start --enable-memory-saver.
    Generation is paused first (weight_sync.pause_mode): SGLang asserts an idle engine."""
    return_routed_experts: bool = True
    """MoE models (ignored for dense ones): engines return the experts each token was routed
    to (SGLang's --enable-return-routed-experts), which ride with the samples for
    algo.routing_replay and the train/routing_mismatch_frac metric. Costs SGLang a host buffer
    of tokens x layers x top-k int32; false turns both off."""
    deterministic: bool = False
    """Reproducible rollouts: every sequence's tokens follow from its seed (run seed, group,
    sample), whatever else is batched, so a resumed run draws the same tokens. The hf engine
    always does this; sglang engines only with --enable-deterministic-inference, which this
    adds (a batch-invariant sampler and kernels: slower, see docs/engines.md#seeds). Without it
    SGLang ignores sampling_params.sampling_seed."""
    partial_rollout: bool = True
    """weight_sync.pause_mode=abort (ignored otherwise): a sequence a weight sync aborts
    continues from its prefix on the new weights (its sample then spans two versions, recorded
    in version_spans; docs/engines.md#pause-modes). false: the whole group is generated again
    from scratch, so every sample's tokens come from one version, at the price of the tokens
    thrown away. Multi-turn episodes and the agent proxy always do the latter."""
    agent_mode: str = "env"
    """env: the worker draws prompts from data.* and runs them (single-turn, or episodes of
    env.name); proxy: it serves an OpenAI-compatible /v1/chat/completions for external agent
    programs and trains on their sessions (docs/agentic.md)."""
    proxy_port: int = 0
    """agent_mode=proxy: the proxy's TCP port on the rollout node (0: a free one, written to
    RUN_DIR/plan.json and roles.json)."""
    proxy_session_timeout_s: float = 600.0
    """agent_mode=proxy: a group whose sessions see no request for this long is dropped (its
    admission credit goes back), so a crashed agent cannot stall the run."""
    proxy_admission_timeout_s: float = 300.0
    """agent_mode=proxy: how long the first request of a new group waits for an admission
    credit (the staleness bound) before it is answered 503."""

    @property
    def generate_timeout_s(self) -> float:
        """rollout.request_timeout_s, or 300 s plus 0.1 s per new token: a decode floor of 10
        tokens/s for each sequence of a full batch (GPUs decode several times faster; a hung
        engine is found by its health check, not by this timeout)."""
        if self.request_timeout_s is not None:
            return self.request_timeout_s
        return BASE_GENERATE_TIMEOUT_S + self.max_new_tokens * GENERATE_S_PER_TOKEN

    def __post_init__(self) -> None:
        check(self.agent_mode in ("env", "proxy"),
               f"rollout.agent_mode={self.agent_mode!r}: use env or proxy")
        check(0 <= self.proxy_port < 65536, f"rollout.proxy_port={self.proxy_port}: 0..65535")
        check(self.proxy_session_timeout_s > 0 and self.proxy_admission_timeout_s > 0,
               "rollout.proxy_session_timeout_s and rollout.proxy_admission_timeout_s must be > 0")
        check(self.engine_tp_size >= 1, f"rollout.engine_tp_size={self.engine_tp_size}: >= 1")
        check(self.engine_ep_size >= 1 and self.engine_tp_size % self.engine_ep_size == 0,
               f"rollout.engine_ep_size={self.engine_ep_size}: must divide "
               f"rollout.engine_tp_size={self.engine_tp_size}")
        check(0 < self.engine_mem_fraction < 1,
               f"rollout.engine_mem_fraction={self.engine_mem_fraction}: must be in (0, 1)")
        check(self.engine == "sglang" or (self.engine_tp_size == 1 and self.engine_ep_size == 1),
               f"rollout.engine_tp_size/engine_ep_size > 1 need rollout.engine=sglang "
               f"(rollout.engine={self.engine!r})")
        check(self.engine_device in ("auto", "cuda", "cpu"),
               f"rollout.engine_device={self.engine_device!r}: use auto, cuda or cpu")
        check(self.engine_device != "cpu" or self.engine_tp_size == 1,
               f"rollout.engine_device=cpu runs one SGLang process per engine: set "
               f"rollout.engine_tp_size=1 (not {self.engine_tp_size})")
        for flag in ("--pp-size", "--pipeline-parallel-size", "--dp-size", "--data-parallel-size"):
            value = extra_arg(self.engine_extra_args, flag)
            check(value is None or value == "1",
                  f"rollout.engine_extra_args: {flag} {value}: an engine must be one "
                  "tensor-parallel group (the weight sync gives it ranks rank_offset .. "
                  "rank_offset + engine_tp_size - 1, and SGLang's weight-update group asserts "
                  "dp_size == 1); start more engines instead (rollout.num_engines)")
        check(self.engine in ("hf", "sglang"),
               f"rollout.engine={self.engine!r}: use hf (CPU) or sglang (GPU)")
        # the hf engine takes none of them: they were dropped without a word
        check(self.engine == "sglang" or not self.engine_extra_args,
              f"rollout.engine_extra_args={self.engine_extra_args}: these are flags of "
              f"`python -m sglang.launch_server`, and rollout.engine={self.engine!r} takes "
              "none; drop them, or run SGLang engines (rollout=sglang)")
        check(self.num_engines >= 1, f"rollout.num_engines={self.num_engines}: must be >= 1")
        check(self.batch_size >= 1, f"rollout.batch_size={self.batch_size}: must be >= 1")
        check(self.n_samples_per_prompt >= 2,
               f"rollout.n_samples_per_prompt={self.n_samples_per_prompt}: GRPO needs >= 2 "
               "samples per prompt to compare")
        check(self.groups_per_request >= 1,
               f"rollout.groups_per_request={self.groups_per_request}: must be >= 1")
        check(self.max_new_tokens >= 1, f"rollout.max_new_tokens={self.max_new_tokens}: >= 1")
        check(self.temperature > 0,
               f"rollout.temperature={self.temperature}: must be > 0 for RL sampling")


def extra_arg(args: list[str], flag: str) -> Optional[str]:
    """The value `args` give `flag` (`--flag V` or `--flag=V`; the last one wins), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag:
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value
