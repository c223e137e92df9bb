"""`python -m relax_slurm.broker --config RUN_DIR/config.yaml --router ADDR --pub ADDR`.

Serves until a `shutdown` request or SIGTERM/SIGINT, then exits 0. Addresses may use a `*`
port (`tcp://127.0.0.1:*`); the bound endpoints are printed on the first line of stdout.
The run's secret comes from the environment (RELAX_RUN_SECRET, set by relax-train); without it
the broker does not start.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from types import FrameType

from relax_slurm.auth import SECRET_ENV, run_secret
from relax_slurm.broker.elastic import Elastic
from relax_slurm.broker.server import BrokerServer
from relax_slurm.broker.spill import Spill, replay
from relax_slurm.broker.state import BrokerState
from relax_slurm.config import TrainConfig, load_config
from relax_slurm.errors import ConfigError, RelaxError
from relax_slurm.runtime.plan import PLAN_FILE, load_plan
from relax_slurm.runtime.stacks import register_stack_dumps


ELASTIC_FILE = "elastic.json"


def _log(line: str) -> None:
    print(line, flush=True)


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--admin {text!r}: expected HOST:PORT")
    return host, int(port)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m relax_slurm.broker", description=__doc__)
    parser.add_argument("--config", required=True, help="the run's config.yaml")
    parser.add_argument("--router", required=True, help="request socket, e.g. tcp://node1:5555")
    parser.add_argument("--pub", required=True, help="broadcast socket, e.g. tcp://node1:5556")
    parser.add_argument("--admin", default=None, metavar="HOST:PORT",
                        help="admin HTTP (GET /status), e.g. node1:8080; port 0 lets the OS pick")
    parser.add_argument("--restore", default=None,
                        help="a checkpoint's meta.json: resume its version and counters")
    parser.add_argument("--spill", default=None, type=Path,
                        help="record the state in this file (append-only; see broker/spill.py)")
    parser.add_argument("--replay", action="store_true",
                        help="continue from the --spill file (a restart in place) instead of "
                             "starting it anew")
    return parser


def _state(args: argparse.Namespace, cfg: TrainConfig
           ) -> tuple[BrokerState, Spill | None, list]:
    """The broker's state (replayed from the spill, restored from a checkpoint, or new), its
    spill file, and the answers a replay remembers for resent requests."""
    # closed until the trainer's first set_version: engines must hold its weights first
    state = BrokerState(cfg.algo.max_staleness, cfg.rollout.batch_size, open_admission=False)
    spill, answers = None, []
    if args.replay:
        if args.spill is None:
            raise ConfigError("--replay needs --spill FILE")
        replayed = replay(args.spill)
        if replayed.snapshot is not None:
            state.load_snapshot(replayed.snapshot, list(replayed.queue.values()))
            answers = replayed.answers
        _log(f"broker: replayed {replayed.records} records of {args.spill} "
             f"({replayed.torn_bytes} torn bytes cut): {state.counters()}")
        spill = Spill(args.spill, cfg.broker.spill_fsync, cfg.broker.spill_compact_mb << 20,
                      replayed)
    elif args.restore:
        counters = json.loads(open(args.restore).read())["extra_state"]["broker"]
        state.restore(counters)
        _log(f"broker: restored from {args.restore}: {counters}")
    if spill is None and args.spill is not None:
        spill = Spill(args.spill, cfg.broker.spill_fsync, cfg.broker.spill_compact_mb << 20)
        spill.start(state)
    return state, spill, answers


def _elastic(args: argparse.Namespace, cfg: TrainConfig) -> tuple[Elastic, Path | None]:
    """The engine list and the file it is kept in (see broker/elastic_routes.py)."""
    # the engines of the launch (protected from scale-in); a broker started by hand without
    # a plan beside its config starts with none (scale_out registers external ones)
    run_dir = Path(args.config).resolve().parent
    initial = load_plan(run_dir).engine_urls if (run_dir / PLAN_FILE).exists() else []
    elastic = Elastic(initial, default_timeout_s=cfg.cluster.elastic.timeout_s,
                      drain_timeout_s=cfg.cluster.elastic.drain_timeout_s,
                      max_engines=cfg.cluster.elastic.max_engines)
    # beside the spill file; a restart in place (--replay) continues from it
    elastic_file = args.spill.parent / ELASTIC_FILE if args.spill is not None else None
    if args.replay and elastic_file is not None and elastic_file.exists():
        elastic.load(json.loads(elastic_file.read_text()))
        _log(f"broker: elastic rollout state from {elastic_file}: "
             f"routable={elastic.routable_urls()} op={elastic.current}")
    return elastic, elastic_file


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # its stacks on SIGUSR2 (relax-ctl dump) in a run's dir: its config's folder, with a plan
    run_dir = Path(args.config).resolve().parent
    register_stack_dumps(run_dir if (run_dir / PLAN_FILE).exists() else None, "broker")
    try:
        secret = run_secret()
        if secret is None:
            raise ConfigError(f"{SECRET_ENV} is not set: the broker serves authenticated "
                              "clients only. relax-train sets it; by hand, export it (e.g. "
                              "`export RELAX_RUN_SECRET=$(cat RUN_DIR/secret)`)")
        cfg = load_config(args.config)
        state, spill, answers = _state(args, cfg)
        elastic, elastic_file = _elastic(args, cfg)
        server = BrokerServer(state, args.router, args.pub, secret=secret, elastic=elastic,
                              elastic_file=elastic_file,
                              admin=_hostport(args.admin) if args.admin else None,
                              spill=spill, answers=answers,
                              max_message_bytes=cfg.broker.max_message_mb << 20, log=_log)
    except RelaxError as e:
        print(f"broker: {e}", file=sys.stderr, flush=True)
        return 2

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        _log(f"broker: got {signal.Signals(signum).name}, stopping")
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    admin = f" admin={server.admin.url}" if server.admin else ""
    _log(f"broker: listening router={server.router_endpoint} pub={server.pub_endpoint}{admin} "
         f"max_staleness={state.max_staleness} batch_size={state.batch_size}")
    server.serve()
    _log("broker: stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
