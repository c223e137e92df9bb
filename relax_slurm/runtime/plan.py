"""Where every role of a run lives: the addresses each process needs, as one small JSON file.

The launcher (local, or inside a Slurm allocation) decides the plan and writes
`RUN_DIR/plan.json` before starting the roles; each role reads it with `load_plan`. Only the
launcher decides addresses; roles never read `SLURM_*`. One exception picks a port: trainer
rank 0 re-forming the weight-sync group with a restarted engine (weightsync/cohort.py) takes a
free one on its own host, as the first group's port may still be held. Ports come from
runtime/ports.py (free_port).
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from relax_slurm.errors import ConfigError

PLAN_FILE = "plan.json"


@dataclass(kw_only=True)
class RunPlan:
    broker_router: str
    """ZMQ address of the broker's request socket, e.g. tcp://10.0.0.1:5555."""
    broker_pub: str
    """ZMQ address of the broker's broadcast socket."""
    broker_admin: str | None = None
    """http://HOST:PORT of the broker's admin HTTP (GET /status), or None."""
    engine_urls: list[str] = field(default_factory=list)
    """Base URLs of the inference engines (hf or SGLang), e.g. http://10.0.0.2:30000."""
    teacher_url: str | None = None
    """Base URL of the teacher engine (algo.teacher_model_path; on-policy distillation), or
    None. It scores responses only and never joins the weight sync."""
    genrm_url: str | None = None
    """Base URL of the managed judge engine (reward.genrm_model_path; genrm rewards), or None.
    Like the teacher it only answers /generate and never joins the weight sync."""
    proxy_url: str | None = None
    """Base URL of the rollout worker's OpenAI-compatible proxy (rollout.agent_mode=proxy),
    e.g. http://10.0.0.2:8000; agents use {proxy_url}/s/{group}/{name}/v1."""
    weight_sync_host: str = "127.0.0.1"
    """Address of trainer rank 0, which hosts the weight-sync group's TCP store."""
    weight_sync_port: int = 0
    trainer_master_port: int = 0
    """torchrun rendezvous port on the first trainer node."""
    resume_from: str | None = None
    """Checkpoint directory every role resumes from (resolved once by the launcher), or None."""

    def reward_config(self, reward: Any) -> Any:
        """The run's RewardConfig as the reward functions read it: with a managed judge
        (reward.genrm_model_path, kept: the judge client sends the run's engine key to that
        judge only) its URL in this plan becomes reward.genrm_url."""
        if not getattr(reward, "genrm_model_path", None):
            return reward
        if self.genrm_url is None:
            raise ConfigError(f"reward.genrm_model_path={reward.genrm_model_path} is set but the "
                              "run plan has no judge engine: start the run with relax-train")
        return replace(reward, genrm_url=self.genrm_url)


def address_toward(urls: list[str]) -> str:
    """This host's address on the interface that routes to the first of `urls`' hosts: where
    engines connect back to (the weight-sync group's master on trainer rank 0). Not
    gethostname(): on a cluster node it may resolve to another network than the engines'
    (a management network, or 127.0.1.1 as Debian's /etc/hosts has it). A UDP connect sends
    nothing; it only asks the kernel for the route. gethostname() when there is no route."""
    from urllib.parse import urlsplit

    for url in urls:
        host = urlsplit(url).hostname
        if not host:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))  # discard port: any port will do, nothing is sent
                return str(s.getsockname()[0])
        except OSError:
            continue
    return socket.gethostname()


def save_plan(plan: RunPlan, run_dir: str | Path) -> Path:
    path = Path(run_dir) / PLAN_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(plan), indent=2))
    tmp.replace(path)
    return path


def load_plan(run_dir: str | Path) -> RunPlan:
    path = Path(run_dir) / PLAN_FILE
    try:
        return RunPlan(**json.loads(path.read_text()))
    except FileNotFoundError as e:
        raise ConfigError(f"{path} is missing: roles are started by relax-train, which "
                          "writes it") from e
    except (TypeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a valid run plan: {e}") from e
