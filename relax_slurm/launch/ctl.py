"""`relax-ctl`: talk to a running run's broker admin HTTP with the run's secret.

    relax-ctl status RUN_DIR          GET /status, printed as JSON (exit 1 if it does not answer)

The address comes from RUN_DIR/plan.json (`broker_admin`), the token from RUN_DIR/secret; the
same as `curl -H "Authorization: Bearer $(cat RUN_DIR/secret)" ADMIN/status`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from relax_slurm.auth import read_secret
from relax_slurm.errors import ConfigError, RelaxError
from relax_slurm.launch.plan import load_plan


def admin_get(run_dir: Path, route: str, timeout_s: float) -> dict:
    plan = load_plan(run_dir)
    if not plan.broker_admin:
        raise ConfigError(f"{run_dir}/plan.json has no broker_admin: the run predates the admin "
                          "HTTP")
    url = plan.broker_admin + route
    try:
        r = httpx.get(url, timeout=timeout_s,
                      headers={"Authorization": f"Bearer {read_secret(run_dir)}"})
    except httpx.HTTPError as e:
        raise RelaxError(f"{url}: {type(e).__name__}: {e}; is the run still going?") from e
    if r.status_code != 200:
        raise RelaxError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relax-ctl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="the broker's view of the run (GET /status)")
    status.add_argument("run_dir", type=Path)
    status.add_argument("--timeout-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    try:
        print(json.dumps(admin_get(args.run_dir, "/status", args.timeout_s), indent=2))
    except RelaxError as e:
        print(f"relax-ctl: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
