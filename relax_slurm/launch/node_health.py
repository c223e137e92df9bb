"""Are the allocation's nodes still fit to run steps? Asked by the Slurm driver after a failure,
before it restarts every role in the same allocation: a global restart onto a node that is
down, drained or not responding would only fail again (an srun step cannot be placed there,
or dies with the node), so the driver requeues the job instead and Slurm starts it on healthy
nodes, where it resumes from its latest checkpoint (launch/slurm_driver.py).

Slurm itself kills a job whose node it declares DOWN, and requeues it (`--requeue`); this
covers what it leaves running: a node drained (a health check, an admin), not responding yet,
or failing.
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Iterable

log = logging.getLogger("relax_slurm.slurm")
SCONTROL_TIMEOUT_S = 30
# `State=` of `scontrol show node`: a base state and +flags (MIXED+DRAIN, IDLE+NOT_RESPONDING)
UNFIT = frozenset({"DOWN", "DRAIN", "FAIL", "ERROR", "NOT_RESPONDING", "POWERED_DOWN",
                   "POWERING_DOWN", "FUTURE"})
_NODE = re.compile(r"NodeName=(\S+).*?\bState=(\S+)")


def node_states(text: str) -> dict[str, str]:
    """node name -> its State= field, from `scontrol show node -o` (one line per node)."""
    return {m.group(1): m.group(2) for m in map(_NODE.search, text.splitlines()) if m}


def unfit(states: dict[str, str]) -> dict[str, str]:
    """The nodes whose state has a base state or flag in UNFIT (a trailing `*` too: sinfo's
    mark of a node not responding)."""
    return {node: state for node, state in states.items()
            if state.endswith("*") or UNFIT & set(state.rstrip("*").split("+"))}


def lost_nodes(hosts: Iterable[str]) -> dict[str, str]:
    """The unfit nodes among `hosts`, with their state. {} when scontrol cannot say (the
    controller unreachable): the driver then restarts in place as usual."""
    names = ",".join(dict.fromkeys(hosts))
    try:
        r = subprocess.run(["scontrol", "show", "node", "-o", names], capture_output=True,
                           text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not read the state of nodes %s: %s", names, e)
        return {}
    if r.returncode != 0:
        log.warning("scontrol show node %s failed: %s", names, r.stderr.strip())
        return {}
    return unfit(node_states(r.stdout))
