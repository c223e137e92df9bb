"""The local runner (cluster=local): every role a subprocess of this one on this machine.

Start order: broker, engines (wait for /health), rollout worker, torchrun trainer. Then watch:
the run ends when the trainer exits 0; any other exit, or no new step for
`cluster.step_timeout_s`, fails the run naming the role and its log. Every child is stopped in
`finally`, Ctrl-C included.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from relax_slurm.config import TrainConfig, save_config
from relax_slurm.errors import ConfigError, RelaxError, RoleFailed
from relax_slurm.launch.plan import RunPlan, free_port, save_plan
from relax_slurm.launch.processes import ProcessSet, Role
from relax_slurm.metrics.jsonl import METRICS_FILE, iter_metrics
from relax_slurm.metrics.progress import Progress
from relax_slurm.metrics.summary import summarize, write_summary
from relax_slurm.rollout.engine_client import EngineClient

POLL_S = 0.5


def child_env(cfg: TrainConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",  # everything is local; never wait on a hub
        "OMP_NUM_THREADS": str(max(cfg.trainer.torch_threads, cfg.rollout.torch_threads)),
    })
    return env


def check_inputs(cfg: TrainConfig) -> None:
    model = Path(cfg.model.path)
    if not (model / "config.json").is_file():
        raise ConfigError(
            f"model.path={cfg.model.path}: no config.json there. Point model.path at a Hugging "
            "Face model directory, or build the tiny demo model with "
            "`python tools/make_tiny_model.py --out tiny/model`"
        )
    for f in cfg.data.train_files:
        if not Path(f).exists():
            raise ConfigError(
                f"data.train_files: {f} does not exist. For the demo data run "
                "`python tools/prepare_data.py --out tiny`"
            )


def make_plan(cfg: TrainConfig) -> RunPlan:
    host = cfg.broker.host
    return RunPlan(
        broker_router=f"tcp://{host}:{free_port(host)}",
        broker_pub=f"tcp://{host}:{free_port(host)}",
        engine_urls=[f"http://127.0.0.1:{free_port()}" for _ in range(cfg.rollout.num_engines)],
        weight_sync_host="127.0.0.1",
        weight_sync_port=free_port(),
        trainer_master_port=free_port(),
    )


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def start_roles(procs: ProcessSet, cfg: TrainConfig, plan: RunPlan, run_dir: Path) -> Role:
    py = sys.executable
    config = str(run_dir / "config.yaml")
    procs.start("broker", [py, "-m", "relax_slurm.broker", "--config", config,
                           "--router", plan.broker_router, "--pub", plan.broker_pub],
                ports={"router": _port(plan.broker_router), "pub": _port(plan.broker_pub)})
    engines = []
    for i, url in enumerate(plan.engine_urls):
        engines.append(procs.start(f"engine{i}", [
            py, "-m", "relax_slurm.rollout.hf_engine", "--model-path", cfg.model.path,
            "--host", "127.0.0.1", "--port", str(_port(url)), "--dtype", cfg.model.dtype,
            "--max-batch-size", str(cfg.rollout.engine_max_batch_size),
            "--batch-wait-ms", str(cfg.rollout.engine_batch_wait_ms),
            "--torch-threads", str(cfg.rollout.torch_threads),
            "--seed", str(cfg.seed + i), "--weight-version", "0",
        ], ports={"http": _port(url)}, cpus=cfg.cluster.rollout_cpus))
    wait_healthy(procs, engines, plan.engine_urls, cfg.rollout.startup_timeout_s)
    procs.start("rollout", [py, "-m", "relax_slurm.rollout.worker", "--run-dir", str(run_dir)],
                cpus=cfg.cluster.rollout_cpus)
    return procs.start("trainer", [
        py, "-m", "torch.distributed.run", "--nnodes=1",
        f"--nproc-per-node={cfg.trainer.nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{plan.trainer_master_port}",
        "-m", "relax_slurm.trainer", "--run-dir", str(run_dir),
    ], ports={"rdzv": plan.trainer_master_port, "weight_sync": plan.weight_sync_port},
        cpus=cfg.cluster.trainer_cpus)


def wait_healthy(procs: ProcessSet, roles: list[Role], urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(zip(urls, roles))
    while pending:
        procs.check_alive()
        for url in list(pending):
            try:
                EngineClient(url, timeout_s=2.0).health()
                pending.pop(url)
            except RelaxError:
                pass
        if pending and time.monotonic() > deadline:
            raise next(iter(pending.values())).failure(
                f"did not answer /health within rollout.startup_timeout_s={timeout_s}s")
        time.sleep(POLL_S)


def watch(procs: ProcessSet, trainer: Role, cfg: TrainConfig, run_dir: Path) -> None:
    progress = Progress(cfg.trainer.total_steps, enabled=cfg.metrics.progress)
    metrics_path = run_dir / METRICS_FILE
    seen, last_step_t = 0, time.monotonic()
    try:
        while True:
            rows = list(iter_metrics(metrics_path))
            for row in rows[seen:]:
                progress.update(row)
                last_step_t = time.monotonic()
            seen = max(seen, len(rows))
            if trainer.proc.poll() == 0:
                return
            procs.check_alive()
            if time.monotonic() - last_step_t > cfg.cluster.step_timeout_s:
                raise trainer.failure(
                    f"made no step for cluster.step_timeout_s={cfg.cluster.step_timeout_s}s "
                    "(hung?); see also logs/rollout.log and logs/engine*.log")
            time.sleep(POLL_S)
    finally:
        progress.close()


def run_local(cfg: TrainConfig) -> dict:
    """Run to the end; returns the summary. Raises RoleFailed/ConfigError with the cause."""
    check_inputs(cfg)
    run_dir = Path(cfg.run_dir).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    plan = make_plan(cfg)
    save_plan(plan, run_dir)
    t0 = time.monotonic()
    procs = ProcessSet(run_dir / "logs", child_env(cfg))
    try:
        trainer = start_roles(procs, cfg, plan, run_dir)
        (run_dir / "roles.json").write_text(json.dumps([r.info() for r in procs.roles], indent=2))
        watch(procs, trainer, cfg, run_dir)
    finally:
        procs.close()
    rows = list(iter_metrics(run_dir / METRICS_FILE))
    summary = summarize(rows, time.monotonic() - t0, cfg.algo.max_staleness)
    write_summary(run_dir, summary)
    if len(rows) < cfg.trainer.total_steps:
        raise RoleFailed(f"trainer exited after {len(rows)} of {cfg.trainer.total_steps} steps; "
                         f"see {run_dir / 'logs' / 'trainer.log'}")
    return summary
