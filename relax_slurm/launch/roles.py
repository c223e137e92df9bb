"""What to run for each role of a run: pure functions from (config, plan) to command lines,
and the environment every role runs in (`child_env`).

The same specs serve the local runner (run as they are) and the Slurm driver (each prefixed
with `srun --het-group=K ...` for the nodes it goes to), so both launch identical programs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from relax_slurm.auth import SECRET_ENV
from relax_slurm.config import TrainConfig
from relax_slurm.config.cluster import LocalClusterConfig, SlurmClusterConfig
from relax_slurm.runtime.plan import RunPlan
from relax_slurm.engines import sglang_api
from relax_slurm.engines.sglang_api import API_KEY_ENV
from relax_slurm.routing.shape import routing_shape
from relax_slurm.runtime.ports import free_port
from relax_slurm.runtime.zygote import model_code

TRAINER_GROUP, ROLLOUT_GROUP = 0, 1
SPILL_FILE = "broker/spill.bin"  # Slurm het groups: trainer + broker, engines + workers


@dataclass(kw_only=True)
class RoleSpec:
    name: str
    argv: list[str]
    het_group: int
    host: str
    """Where it runs (a node name on Slurm, 127.0.0.1 locally)."""
    ports: dict[str, int] = field(default_factory=dict)
    cpus: list[int] | None = None
    """CPU ids to pin to (local runs only)."""
    health_url: str | None = None
    """Poll this engine URL's /health before starting later roles."""
    restart_argv: list[str] | None = None
    """How to start it again in place after it died (None: its death ends the attempt)."""


Wrap = Callable[[RoleSpec], list[str]]
"""How a launcher runs a spec's command: as it is (local), or inside `srun ...` (Slurm)."""


def engine_api_key(secret: str) -> str:
    """The engines' API key: RELAX_ENGINE_API_KEY when the user set it, else the run's secret."""
    return os.environ.get(API_KEY_ENV, secret)


def child_env(cfg: TrainConfig, secret: str) -> dict[str, str]:
    """The roles' environment: the launcher's, plus the run's secret (the broker's auth token
    and, unless the user set RELAX_ENGINE_API_KEY, the engines' API key too)."""
    env = dict(os.environ)
    env[SECRET_ENV] = secret
    env[API_KEY_ENV] = engine_api_key(secret)
    env.update({
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",  # everything is local; never wait on a hub
        "OMP_NUM_THREADS": str(max(cfg.trainer.torch_threads, cfg.rollout.torch_threads)),
    })
    # a role that dies in native code (SIGSEGV, SIGABRT) logs the Python stacks of its threads
    # (launch/processes.py log_tail names the frame); PYTHONFAULTHANDLER= (empty) turns it off
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def _hostport(url: str) -> tuple[str, int]:
    u = urlparse(url)
    return u.hostname or "127.0.0.1", int(u.port or 0)


def broker_spec(cfg: TrainConfig, plan: RunPlan, run_dir: Path) -> RoleSpec:
    host, router = _hostport(plan.broker_router)
    _, pub = _hostport(plan.broker_pub)
    # the address the plan gives every client (127.0.0.1 locally, the node's name on Slurm),
    # never all interfaces: the broker is reachable where the run needs it and nowhere else
    ports = {"router": router, "pub": pub}
    admin: list[str] = []
    if plan.broker_admin:
        ports["admin"] = _hostport(plan.broker_admin)[1]
        admin = ["--admin", f"{host}:{ports['admin']}"]
    argv = [sys.executable, "-m", "relax_slurm.broker", "--config", str(run_dir / "config.yaml"),
            "--router", f"tcp://{host}:{router}", "--pub", f"tcp://{host}:{pub}", *admin,
            *(["--restore", str(Path(plan.resume_from) / "meta.json")] if plan.resume_from
              else [])]
    restart = None
    if cfg.broker.spill:
        argv += ["--spill", str(run_dir / SPILL_FILE)]
        restart = [*argv, "--replay"]  # same ports: clients reconnect and resend
    return RoleSpec(name="broker", het_group=TRAINER_GROUP, host=host, ports=ports, argv=argv,
                    restart_argv=restart)


def _hf_engine_spec(cfg: TrainConfig, name: str, url: str, model_path: str, seed: int
                    ) -> RoleSpec:
    host, port = _hostport(url)
    # bound to the address the plan gives its clients (127.0.0.1 locally, the node's name on
    # Slurm), like the broker: never all interfaces
    return RoleSpec(
        name=name, het_group=ROLLOUT_GROUP, host=host, ports={"http": port},
        cpus=pinned_cpus(cfg, "rollout"), health_url=url,
        argv=[sys.executable, "-m", "relax_slurm.engines.hf",
              "--model-path", model_path, "--host", host, "--port", str(port),
              "--dtype", cfg.model.dtype,
              "--max-batch-size", str(cfg.rollout.engine_max_batch_size),
              "--batch-wait-ms", str(cfg.rollout.engine_batch_wait_ms),
              "--torch-threads", str(cfg.rollout.torch_threads),
              "--seed", str(seed), "--weight-version", "0", *_media_flags(cfg),
              *(["--enable-return-routed-experts"] if returns_routing(cfg, model_path) else []),
              *(sglang_api.LORA_FLAGS if serves_adapter(cfg, model_path) else ())],
    )


def serves_adapter(cfg: TrainConfig, model_path: str) -> bool:
    """Whether this engine serves model.lora's adapter (the policy's engines, when each sync
    sends the adapter alone; a teacher or judge never)."""
    return model_path == cfg.model.path and cfg.model.lora.enabled and cfg.adapter_sync


def returns_routing(cfg: TrainConfig, model_path: str) -> bool:
    """Whether the policy's engines report routed experts: an MoE model.path (read from its
    config.json where the launcher runs) with rollout.return_routed_experts. A teacher or judge
    never (only model.path's engines report routing)."""
    return (cfg.rollout.return_routed_experts and model_path == cfg.model.path
            and routing_shape(model_path) is not None)


def _media_flags(cfg: TrainConfig) -> list[str]:
    """The data's media limits, so the engine processes media as the rollout worker does."""
    d = cfg.data
    if not d.multimodal_keys:
        return []
    flags = ["--audio-sampling-rate-hz", str(d.audio_sampling_rate_hz),
             "--video-fps", str(d.video_fps), "--video-min-frames", str(d.video_min_frames),
             "--video-max-frames", str(d.video_max_frames)]
    for flag, value in (("--image-min-pixels", d.image_min_pixels),
                        ("--image-max-pixels", d.image_max_pixels),
                        ("--video-max-pixels", d.video_max_pixels)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def sglang_media_args(cfg: TrainConfig, model_path: str) -> list[str]:
    """The data's image limits for an SGLang engine of a multimodal run (its own image
    processor resizes; a different token count fails the run at its first prompt)."""
    d = cfg.data
    if not d.multimodal_keys:
        return []
    return sglang_api.mm_process_args(model_path, d.image_min_pixels, d.image_max_pixels,
                                      cfg.rollout.engine_extra_args)


def pinned_cpus(cfg: TrainConfig, role: str) -> list[int] | None:
    """CPU ids the `role` ("trainer" or "rollout") is pinned to: cluster.trainer_cpus /
    rollout_cpus, which only a local cluster has (on Slurm the allocation places the roles)."""
    c = cfg.cluster
    if not isinstance(c, LocalClusterConfig):
        return None
    return c.trainer_cpus if role == "trainer" else c.rollout_cpus


def base_gpu_id(cfg: TrainConfig, slot: int) -> int:
    """First GPU of the engine in `slot` (0, 1, ... among the engines of its node).

    Separate pools: engines on a node the trainer also uses (local runs, or
    cluster.layout=colocated with cluster.rollout_nodes=0) start after the trainer's
    trainer.nproc_per_node GPUs. Shared GPUs (rollout.release_memory_during_train): engines
    start at GPU 0 and free their memory while the trainer steps."""
    c, r = cfg.cluster, cfg.rollout
    shares_node = not isinstance(c, SlurmClusterConfig) or (
        c.layout == "colocated" and c.rollout_nodes == 0)
    offset = (cfg.trainer.nproc_per_node
              if shares_node and not r.release_memory_during_train else 0)
    return offset + slot * r.engine_tp_size


def _sglang_engine_spec(cfg: TrainConfig, name: str, url: str, model_path: str, seed: int,
                        slot: int = 0, base_gpu: int | None = None) -> RoleSpec:
    """`python -m sglang.launch_server` on rollout.engine_tp_size GPUs of its node, from
    `base_gpu` (default: `base_gpu_id(cfg, slot)`), bound to the plan's address for it."""
    host, port = _hostport(url)
    r = cfg.rollout
    cpu = r.engine_device == "cpu"
    return RoleSpec(
        name=name, het_group=ROLLOUT_GROUP, host=host, ports={"http": port}, health_url=url,
        cpus=pinned_cpus(cfg, "rollout") if cpu else None,
        argv=sglang_api.server_argv(
            r.engine_python or sys.executable, model_path=model_path,
            host=host, port=port,
            base_gpu_id=base_gpu_id(cfg, slot) if base_gpu is None else base_gpu,
            tp_size=r.engine_tp_size, ep_size=r.engine_ep_size,
            mem_fraction_static=r.engine_mem_fraction,
            dtype=cfg.model.dtype, seed=seed, trust_remote_code=cfg.model.trust_remote_code,
            api_key=r.engine_api_key,
            enable_memory_saver=r.release_memory_during_train,
            extra_args=[*r.engine_extra_args, *sglang_media_args(cfg, model_path)],
            deterministic=r.deterministic,
            routed_experts=returns_routing(cfg, model_path),
            device="cpu" if cpu else "cuda",
            lora=((cfg.model.lora.rank, list(cfg.model.lora.target_modules))
                  if serves_adapter(cfg, model_path) else None),
            # drawn and reserved where the HTTP port was (a restart reuses both)
            nccl_port=free_port()),
    )


def engine_spec(cfg: TrainConfig, name: str, url: str, model_path: str, seed: int,
                 slot: int = 0, restartable: bool = True, base_gpu: int | None = None
                 ) -> RoleSpec:
    if cfg.rollout.engine == "sglang":
        spec = _sglang_engine_spec(cfg, name, url, model_path, seed, slot, base_gpu)
    else:
        spec = _hf_engine_spec(cfg, name, url, model_path, seed)
    if restartable:  # restarted in place as it was started (see weightsync/cohort.py)
        spec.restart_argv = list(spec.argv)
    return spec


def engines_rejoin(cfg: TrainConfig) -> bool:
    """Whether a restarted engine can get the current weights without a step: trainer rank 0
    re-sends them while it waits for a batch, which needs whole tensors on rank 0 alone (DDP, or
    one rank; under FSDP2 gathering them is a collective of every rank)."""
    t = cfg.trainer
    single = t.nproc_per_node == 1 and cfg.cluster.trainer_node_count() == 1
    return t.strategy == "ddp" or single


def _slots(urls: list[str]) -> list[int]:
    """Index of each engine among the engines of its host, in plan order."""
    seen: dict[str, int] = {}
    slots = []
    for url in urls:
        host = _hostport(url)[0]
        slots.append(seen.get(host, 0))
        seen[host] = slots[-1] + 1
    return slots


def _engine_urls(plan: RunPlan) -> list[str]:
    """Every engine's URL in slot order: the policy's, then the teacher's and the judge's."""
    return [*plan.engine_urls, *(u for u in (plan.teacher_url, plan.genrm_url) if u)]


def engine_specs(cfg: TrainConfig, plan: RunPlan) -> list[RoleSpec]:
    slots = _slots(_engine_urls(plan))
    return [engine_spec(cfg, f"engine{i}", url, cfg.model.path, cfg.seed + i, slots[i],
                         restartable=engines_rejoin(cfg))
            for i, url in enumerate(plan.engine_urls)]


def teacher_specs(cfg: TrainConfig, plan: RunPlan) -> list[RoleSpec]:
    """The teacher engine of on-policy distillation (role `teacher`), if the plan has one: an hf
    engine serving algo.teacher_model_path, outside the weight sync (its weights never change)."""
    if plan.teacher_url is None:
        return []
    assert cfg.algo.teacher_model_path, "plan.teacher_url set without algo.teacher_model_path"
    slot = _slots(_engine_urls(plan))[len(plan.engine_urls)]
    return [engine_spec(cfg, "teacher", plan.teacher_url, cfg.algo.teacher_model_path,
                         cfg.seed, slot)]


def genrm_specs(cfg: TrainConfig, plan: RunPlan) -> list[RoleSpec]:
    """The managed judge engine of the genrm rewards (role `genrm`), if the plan has one:
    reward.genrm_model_path served like the teacher, outside the weight sync, and restarted in
    place when it dies (it holds no state: its weights never change)."""
    if plan.genrm_url is None:
        return []
    assert cfg.reward.genrm_model_path, "plan.genrm_url set without reward.genrm_model_path"
    slot = _slots(_engine_urls(plan))[-1]
    return [engine_spec(cfg, "genrm", plan.genrm_url, cfg.reward.genrm_model_path,
                         cfg.seed, slot)]


def worker_spec(cfg: TrainConfig, plan: RunPlan, run_dir: Path, host: str) -> RoleSpec:
    argv = [sys.executable, "-m", "relax_slurm.rollout", "--run-dir", str(run_dir)]
    return RoleSpec(
        name="rollout", het_group=ROLLOUT_GROUP, host=host, cpus=pinned_cpus(cfg, "rollout"),
        ports={"proxy": _hostport(plan.proxy_url)[1]} if plan.proxy_url else {},
        # the package's __main__, not rollout.worker: see relax_slurm/rollout/__main__.py
        # restarted in place as it is: it rejoins the broker (credits, data position)
        argv=argv, restart_argv=argv,
    )


def trainer_spec(cfg: TrainConfig, plan: RunPlan, run_dir: Path, hosts: list[str]) -> RoleSpec:
    """torchrun with c10d rendezvous on the first trainer host (runtime/torchrun.py: torchrun
    that skips its interpreter's teardown after its ranks finished)."""
    return RoleSpec(
        name="trainer", het_group=TRAINER_GROUP, host=hosts[0], cpus=pinned_cpus(cfg, "trainer"),
        ports={"rdzv": plan.trainer_master_port, "weight_sync": plan.weight_sync_port},
        argv=[sys.executable, "-m", "relax_slurm.runtime.torchrun", f"--nnodes={len(hosts)}",
              f"--nproc-per-node={cfg.trainer.nproc_per_node}", "--rdzv-backend=c10d",
              f"--rdzv-endpoint={hosts[0]}:{plan.trainer_master_port}",
              # torchrun polls its workers every 0.1 s by default: a fifth of a core on a small
              # machine, for failure detection that 1 s serves as well
              "--monitor-interval=1",
              "-m", "relax_slurm.trainer", "--run-dir", str(run_dir)],
    )


def role_imports(cfg: TrainConfig) -> dict[str, list[str]]:
    """The modules this run's Python roles import first, by the module each runs, in the order
    they start (`start_order`), for the zygote to import once (runtime/zygote.py): torchrun's
    agent; the broker; with hf engines the engine's server and the model's transformers code;
    the rollout worker. A name that does not import is skipped there (the role that needs it
    reports why)."""
    imports = {"relax_slurm.runtime.torchrun": ["relax_slurm.runtime.torchrun"]}
    if cfg.supervised:
        return imports
    imports["relax_slurm.broker"] = ["relax_slurm.broker.__main__"]
    if cfg.rollout.engine == "hf":
        paths = {cfg.model.path, cfg.algo.teacher_model_path, cfg.reward.genrm_model_path}
        imports["relax_slurm.engines.hf"] = [
            "relax_slurm.engines.hf.__main__",
            *sorted({m for p in paths if p for m in model_code(p)})]
    imports["relax_slurm.rollout"] = ["relax_slurm.rollout.worker"]
    return imports


def start_order(specs: list[RoleSpec]) -> list[RoleSpec]:
    """The trainer first, then the others as listed: its ranks, fresh processes that import
    the most, are the last role ready (a forked role is ready sooner, runtime/zygote.py)."""
    return sorted(specs, key=lambda spec: spec.name != "trainer")


def run_specs(cfg: TrainConfig, plan: RunPlan, run_dir: Path, rollout_host: str,
              trainer_hosts: list[str]) -> list[RoleSpec]:
    """Every role of the run, in start order. An SFT run (`algo=sft`) is its trainer alone:
    it reads its rows itself and needs no broker, engines or rollout worker."""
    trainer = trainer_spec(cfg, plan, run_dir, trainer_hosts)
    if cfg.supervised:
        return [trainer]
    return [broker_spec(cfg, plan, run_dir), *engine_specs(cfg, plan), *teacher_specs(cfg, plan),
            *genrm_specs(cfg, plan), worker_spec(cfg, plan, run_dir, rollout_host), trainer]
