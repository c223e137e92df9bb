"""What Slurm tells a job about its allocation: the one module that reads `SLURM_*` variables.

Node lists come in Slurm's compressed hostlist form and are expanded here:

    >>> expand_nodelist("node[01-04,07]")
    ['node01', 'node02', 'node03', 'node04', 'node07']
    >>> expand_nodelist("gpu2-[8-10],cpu7")
    ['gpu2-8', 'gpu2-9', 'gpu2-10', 'cpu7']
    >>> expand_nodelist("rack[1-2]-n[1-2]")
    ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']

In a heterogeneous job each component has its own variables (`SLURM_JOB_NODELIST_HET_GROUP_K`,
`SLURM_NTASKS_HET_GROUP_K`, ...) and `SLURM_HET_SIZE` counts the components; a plain job has
`SLURM_JOB_NODELIST` only and is read as one group.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Mapping

from relax_slurm.errors import ConfigError


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at position {i} in node list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unmatched ']' at position {i} in node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in node list {text!r}")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_ranges(body: str, where: str) -> list[str]:
    """"01-03,7" -> ["01", "02", "03", "7"]; the width of the lower bound sets the zero padding."""
    out = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in node list {where!r}")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise ValueError(f"descending range {item!r} in node list {where!r}")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def _expand_one(item: str) -> list[str]:
    """One hostlist element, possibly with several bracket groups (cartesian product)."""
    pieces: list[list[str]] = []
    rest = item
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, close, rest = tail.partition("]")
        if not close:
            raise ValueError(f"unclosed '[' in node list {item!r}")
        pieces.append([head])
        pieces.append(_expand_ranges(body, item))
    if "]" in rest:
        raise ValueError(f"unmatched ']' in node list {item!r}")
    pieces.append([rest])
    return ["".join(p) for p in itertools.product(*pieces)]


def expand_nodelist(text: str) -> list[str]:
    """Every host of a Slurm node list, in Slurm's order; raises ValueError if malformed."""
    text = text.strip()
    if not text or text == "(null)":
        return []
    return [host for item in _split_top(text) for host in _expand_one(item)]


@dataclass(frozen=True)
class SlurmAllocation:
    """The nodes of one job (per het component) and how often it was requeued."""

    job_id: str
    het_groups: tuple[tuple[str, ...], ...]
    """Node names per het component; a plain (non-heterogeneous) job has exactly one."""
    is_het: bool = False
    restart_count: int = 0
    """SLURM_RESTART_COUNT: 0 on the first attempt, +1 per requeue."""
    submit_dir: str = ""

    def nodes(self, group: int) -> list[str]:
        return list(self.het_groups[group])


def _get(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    if value is None:
        raise ConfigError(
            f"{name} is not set: this runs inside a Slurm allocation only (sbatch or salloc), "
            "started by the sbatch script that relax-train renders"
        )
    return value


def _nodes_from(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    raw = _get(env, name)
    try:
        nodes = expand_nodelist(raw)
    except ValueError as e:
        raise ConfigError(f"{name}={raw!r} cannot be parsed: {e}") from e
    if not nodes:
        raise ConfigError(f"{name}={raw!r} lists no node")
    return tuple(nodes)


def read_allocation(env: Mapping[str, str] | None = None) -> SlurmAllocation:
    """The current job's allocation, from `env` (default: this process's environment)."""
    env = os.environ if env is None else env
    job_id = _get(env, "SLURM_JOB_ID")
    het_size = int(env.get("SLURM_HET_SIZE", "0") or 0)
    if het_size:
        groups = tuple(_nodes_from(env, f"SLURM_JOB_NODELIST_HET_GROUP_{k}")
                       for k in range(het_size))
    else:
        groups = (_nodes_from(env, "SLURM_JOB_NODELIST"),)
    return SlurmAllocation(
        job_id=job_id, het_groups=groups, is_het=het_size > 0,
        restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
        submit_dir=env.get("SLURM_SUBMIT_DIR", ""),
    )


def in_allocation(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return "SLURM_JOB_ID" in env


def node_name(env: Mapping[str, str] | None = None) -> str:
    """The Slurm name of the node this job step runs on (SLURMD_NODENAME), the name the run's
    plan uses for addresses."""
    env = os.environ if env is None else env
    return _get(env, "SLURMD_NODENAME")


# SLURM_* variables that configure the client commands rather than describe a job
CLIENT_ENV = ("SLURM_CONF", "SLURM_CLUSTERS")


def without_job_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the SLURM_* variables of the job it was read in (the client's own, such
    as SLURM_CONF, stay): sbatch run inside a job would otherwise pass them on to the new job,
    where some (SLURM_CPUS_PER_TASK, SLURM_MEM_PER_NODE, ...) are taken as its options."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k in CLIENT_ENV}
