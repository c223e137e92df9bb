"""`relax-ctl`: talk to a running run's broker admin HTTP with the run's secret.

    relax-ctl status RUN_DIR                       GET /status, plus `waiting`: what the trainer waits on
    relax-ctl engines RUN_DIR                      GET /rollout/engines
    relax-ctl scale-out RUN_DIR --num-replicas N   POST /rollout/scale_out (absolute target)
    relax-ctl scale-out RUN_DIR --engine-url URL   ... register an engine started elsewhere
    relax-ctl scale-in RUN_DIR --num-replicas N    POST /rollout/scale_in [--force] [--dry-run]
    relax-ctl op-status RUN_DIR ID                 GET /rollout/scale_out/ID
    relax-ctl ops RUN_DIR [--kind scale_in] [--status S]   GET /rollout/scale_out?status=S
    relax-ctl cancel RUN_DIR ID [ID ...]           POST /rollout/scale_out/ID/cancel, each
    relax-ctl cancel-all RUN_DIR [--status S] [--dry-run]  POST /rollout/scale_out_cancel
    relax-ctl stop RUN_DIR [--reason TEXT] [--wait]   end the run after its current step
    relax-ctl dump RUN_DIR [--wait-s S]            every role's stacks -> RUN_DIR/diagnostics/TIME/

Replies are printed as JSON; exit 1 on an HTTP error (409: another operation runs) or when the
broker does not answer (of a run that has ended, it says so: see its summary.json). `--wait`
(scale-out, scale-in) polls the operation until it ends and exits 1 unless it ended
ACTIVE/COMPLETED. The address comes from RUN_DIR/plan.json
(`broker_admin`), the token from RUN_DIR/secret; the same as `curl -H "Authorization: Bearer
$(cat RUN_DIR/secret)" ADMIN/ROUTE`.

`stop` goes through no HTTP: it writes RUN_DIR/control/stop (runtime/control.py); the trainer
saves a final checkpoint after its current step and the run ends as finished, its summary.json
recording `stopped_early`. `--wait` polls until that summary.json is written (or the Slurm
driver's slurm_status.json says the run failed) and prints it.

`dump` goes through no HTTP either: it sends SIGUSR2 to every live role process that registered
its stack dumps (runtime/stacks.py; on Slurm through `srun --overlap` on each role's node),
waits up to --wait-s for each to write, and copies the stacks into a new folder
RUN_DIR/diagnostics/<UTC time>/ (launch/dump.py); it prints the folder and which roles answered
and which did not (a stopped or wedged process cannot answer: that is a finding too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx

from relax_slurm.auth import read_secret
from relax_slurm.errors import ConfigError, RelaxError
from relax_slurm.broker.stats import BrokerStatus
from relax_slurm.launch.dump import dump_stacks
from relax_slurm.launch.waiting import explain
from relax_slurm.metrics.summary import SUMMARY_FILE
from relax_slurm.runtime.control import STATUS_FILE, read_status, request_stop
from relax_slurm.runtime.plan import PLAN_FILE, load_plan

WAIT_POLL_S = 1.0
DUMP_WAIT_S = 10.0


def admin_call(run_dir: Path, method: str, route: str, timeout_s: float,
               body: dict[str, Any] | None = None) -> dict:
    plan = load_plan(run_dir)
    if not plan.broker_admin:
        raise ConfigError(f"{run_dir}/plan.json has no broker_admin: the run predates the admin "
                          "HTTP")
    url = plan.broker_admin + route
    try:
        r = httpx.request(method, url, json=body, timeout=timeout_s,
                          headers={"Authorization": f"Bearer {read_secret(run_dir)}"})
    except httpx.HTTPError as e:
        check_run_dir(run_dir)  # a run that has ended says so, not "connection refused"
        raise RelaxError(f"{url}: {type(e).__name__}: {e}; is the run still going?") from e
    if r.status_code >= 300:
        raise RelaxError(f"{method} {url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def admin_get(run_dir: Path, route: str, timeout_s: float) -> dict:
    return admin_call(run_dir, "GET", route, timeout_s)


def _target(args: argparse.Namespace) -> dict[str, Any]:
    if (args.num_replicas is None) == (not args.engine_url):
        raise ConfigError("give exactly one of --num-replicas N or --engine-url URL (repeatable)")
    if args.num_replicas is not None:
        return {"num_replicas": args.num_replicas}
    return {"engine_urls": args.engine_url}


def wait_op(run_dir: Path, reply: dict, timeout_s: float, wait_s: float) -> dict:
    """Poll the operation `reply` started until it ends (or `wait_s` passes)."""
    rid = reply.get("request_id")
    deadline = time.monotonic() + wait_s
    while rid and reply.get("status") not in ("ACTIVE", "COMPLETED", "FAILED", "CANCELLED"):
        if time.monotonic() > deadline:
            raise RelaxError(f"operation {rid} still {reply.get('status')} after {wait_s}s")
        time.sleep(WAIT_POLL_S)
        reply = admin_get(run_dir, f"/rollout/scale_out/{rid}", timeout_s)
    if reply.get("status") in ("FAILED", "CANCELLED"):
        raise RelaxError(f"operation {rid} {reply['status']}: {reply.get('error')}")
    return reply


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def check_run_dir(run_dir: Path) -> None:
    """A run directory (config.yaml and plan.json, written by relax-train when it starts the
    roles) whose run has not ended yet."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml): give the run_dir "
                          "of a started run (relax-train's run_dir=, where it writes config.yaml "
                          "and plan.json)")
    if not (run_dir / PLAN_FILE).is_file():
        raise ConfigError(f"the run in {run_dir} has not started its roles (no {PLAN_FILE}): "
                          "wait until it has, or cancel a queued Slurm job with scancel")
    ended, started = _mtime_ns(run_dir / SUMMARY_FILE), _mtime_ns(run_dir / PLAN_FILE)
    if ended is not None and started is not None and ended >= started:
        raise RelaxError(f"the run in {run_dir} has ended already: see "
                         f"{run_dir / SUMMARY_FILE}")


def stop(run_dir: Path, reason: str, wait: bool, wait_s: float) -> dict:
    """Ask the run to end after its current step; with `wait`, its summary once it has."""
    check_run_dir(run_dir)
    before = _mtime_ns(run_dir / SUMMARY_FILE)
    path, asked = request_stop(run_dir, reason), time.time()
    if not wait:
        return {"requested": "stop", "reason": reason, "file": str(path),
                "next": "the trainer saves a final checkpoint after its current step, then the "
                        f"run ends; its summary: {run_dir / SUMMARY_FILE}"}
    deadline = time.monotonic() + wait_s
    while _mtime_ns(run_dir / SUMMARY_FILE) == before:
        status = read_status(run_dir)  # (Slurm runs) a failure writes no summary
        if status and status["state"] not in ("running", "completed") and status["time"] > asked:
            raise RelaxError(f"the run ended {status['state']}: {status.get('message')}; see "
                             f"{run_dir / STATUS_FILE}")
        if time.monotonic() > deadline:
            raise RelaxError(f"{run_dir / SUMMARY_FILE} not written within {wait_s}s of the "
                             f"stop request; see {run_dir / 'logs' / 'trainer.log'}")
        time.sleep(WAIT_POLL_S)
    return json.loads((run_dir / SUMMARY_FILE).read_text())


def dump(run_dir: Path, wait_s: float) -> dict:
    """Every live role's stacks into RUN_DIR/diagnostics/<UTC time>/ (launch/dump.py)."""
    check_run_dir(run_dir)
    found = dump_stacks(run_dir, wait_s)
    if not (found.answered or found.did_not_answer):
        raise RelaxError(f"no live role of the run in {run_dir} has registered its stack "
                         f"dumps (diagnostics/stacks/ is empty or its processes are gone): "
                         "are its roles still starting, or from a version before relax-ctl "
                         f"dump? not registered: {', '.join(found.not_registered) or 'none'}")
    return found.to_dict()


def run(args: argparse.Namespace) -> dict:
    t = args.timeout_s
    if args.command == "stop":
        return stop(args.run_dir, args.reason, args.wait, args.wait_s)
    if args.command == "dump":
        return dump(args.run_dir, args.wait_s)
    if args.command == "status":  # plus, in words, what the trainer waits on
        reply = admin_get(args.run_dir, "/status", t)
        return reply | {"waiting": explain(BrokerStatus.from_dict(reply))}
    if args.command == "engines":
        return admin_get(args.run_dir, "/rollout/engines", t)
    if args.command == "op-status":
        return admin_get(args.run_dir, f"/rollout/scale_out/{args.request_id}", t)
    if args.command == "ops":
        query = f"?{urlencode({'status': args.status})}" if args.status else ""
        return admin_get(args.run_dir, f"/rollout/{args.kind}{query}", t)
    if args.command == "cancel":
        replies = [admin_call(args.run_dir, "POST", f"/rollout/scale_out/{rid}/cancel", t)
                   for rid in args.request_id]
        return replies[0] if len(replies) == 1 else {"replies": replies}
    if args.command == "cancel-all":
        body = {"dry_run": args.dry_run, **({"status_filter": args.status} if args.status
                                            else {})}
        return admin_call(args.run_dir, "POST", "/rollout/scale_out_cancel", t, body)
    if args.command == "scale-out":
        body = {**_target(args), **({"timeout_secs": args.timeout_secs}
                                    if args.timeout_secs else {})}
        reply = admin_call(args.run_dir, "POST", "/rollout/scale_out", t, body)
    else:
        body = {**_target(args), "force": args.force, "dry_run": args.dry_run}
        reply = admin_call(args.run_dir, "POST", "/rollout/scale_in", t, body)
    return wait_op(args.run_dir, reply, t, args.wait_s) if args.wait else reply


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relax-ctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002
        s = sub.add_parser(name, help=help)
        s.add_argument("run_dir", type=Path)
        s.add_argument("--timeout-s", type=float, default=10.0, help="per HTTP request")
        return s

    add("status", "the broker's view of the run (GET /status)")
    add("engines", "the rollout engines and the current operation (GET /rollout/engines)")
    add("op-status", "one scale operation (GET /rollout/scale_out/ID)").add_argument(
        "request_id")
    add("cancel", "cancel scale-outs and roll them back").add_argument("request_id", nargs="+")
    s = add("ops", "list scale operations (GET /rollout/scale_out or /rollout/scale_in)")
    s.add_argument("--kind", choices=("scale_out", "scale_in"), default="scale_out")
    s.add_argument("--status", default=None, help="only operations in this status")
    s = add("cancel-all", "cancel every scale-out under way, or those in --status "
                          "(POST /rollout/scale_out_cancel)")
    s.add_argument("--status", default=None, help="only scale-outs in this status")
    s.add_argument("--dry-run", action="store_true", help="only say what would be cancelled")
    for name in ("scale-out", "scale-in"):
        s = add(name, f"POST /rollout/{name.replace('-', '_')}")
        s.add_argument("--num-replicas", type=int, default=None, help="absolute target")
        s.add_argument("--engine-url", action="append", default=[],
                       help="an engine URL (repeatable)")
        s.add_argument("--wait", action="store_true", help="until the operation ends")
        s.add_argument("--wait-s", type=float, default=900.0)
        if name == "scale-out":
            s.add_argument("--timeout-secs", type=float, default=None,
                           help="fail and roll back after this long (default "
                                "cluster.elastic.timeout_s)")
        else:
            s.add_argument("--force", action="store_true", help="do not wait for the drain")
            s.add_argument("--dry-run", action="store_true", help="only say what would go")
    s = add("stop", "end the run after its current step, with a final checkpoint, as finished "
                    "(RUN_DIR/control/stop)")
    s.add_argument("--reason", default="requested", help="recorded in summary.json")
    s.add_argument("--wait", action="store_true", help="until the run has ended; print its "
                                                       "summary")
    s.add_argument("--wait-s", type=float, default=900.0)
    s = add("dump", "every role's Python stacks (SIGUSR2) into RUN_DIR/diagnostics/<UTC time>/")
    s.add_argument("--wait-s", type=float, default=DUMP_WAIT_S,
                   help="how long to wait for each role to write its stacks")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        print(json.dumps(run(args), indent=2), flush=True)
    except RelaxError as e:
        print(f"relax-ctl: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `relax-ctl status RUN | head`: the reader has what it wanted
        # stdout's last buffered bytes can no longer be written: drop them quietly at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
