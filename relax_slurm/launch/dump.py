"""Stack dumps of every role of a live run, into one folder: `dump_stacks(run_dir)`.

What `relax-ctl dump RUN_DIR` runs, and the supervisor before it restarts a role it found hung
or fails an attempt as hung. Each role registered at its start (runtime/stacks.py: a file
`RUN_DIR/diagnostics/stacks/<role>-<pid>.txt`, written to by its dump thread on SIGUSR2); this
signals every live registered process of the run, waits until each file grew (bounded by
`wait_s`), and copies what each wrote into `RUN_DIR/diagnostics/<UTC time>/<label>.txt`, with
`dump.json` beside them naming who answered, who did not, and which roles had not registered.

Which processes: only registered ones (SIGUSR2's default action ends a process that has not
registered yet). Locally, the pids in roles.json and their descendants (the trainer role is
torchrun's agent; its ranks are its children); on Slurm, where the roles run on other nodes,
the registrations this attempt made (the header of each file gives pid and host), signalled by
one `srun --jobid=JOB --overlap` step per node that runs `kill -USR2` on those pids after
checking each is still a relax_slurm process (a pid reused since is left alone).

A role that is signalled and does not answer within `wait_s` is named in `did_not_answer`: a
stopped process (SIGSTOP, a debugger) or one whose C code holds the GIL cannot answer, and that
is itself a finding. A
late answer still lands in its file under diagnostics/stacks/.
"""

from __future__ import annotations

import calendar
import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from relax_slurm.launch.processes import descendants
from relax_slurm.runtime.stacks import (DIAGNOSTICS_DIR, DUMP_SIGNAL, Registration,
                                        registrations)

POLL_S = 0.1
SRUN_TIMEOUT_S = 60.0
# on the node: signal each pid given that is still a relax_slurm process; print those signalled
REMOTE_KILL = ('for p in "$@"; do if grep -qa relax_slurm "/proc/$p/cmdline" 2>/dev/null && '
               f'kill -{DUMP_SIGNAL.name[3:]} "$p" 2>/dev/null; then echo "$p"; fi; done')


@dataclass
class Dump:
    """What one dump found (also `dump.json` in its folder)."""
    folder: Path
    answered: list[str] = field(default_factory=list)
    did_not_answer: list[str] = field(default_factory=list)
    """Signalled, wrote nothing within wait_s (stopped? see the docstring)."""
    not_registered: list[str] = field(default_factory=list)
    """Roles of roles.json with no registered live process (still starting, or a process
    that registers nothing: an external SGLang engine)."""
    wait_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {"folder": str(self.folder)}

    def line(self) -> str:
        """One line for a log."""
        parts = [f"answered: {', '.join(self.answered) or 'none'}"]
        if self.did_not_answer:
            parts.append(f"did not answer: {', '.join(self.did_not_answer)}")
        if self.not_registered:
            parts.append(f"not registered: {', '.join(self.not_registered)}")
        return f"stacks of every role in {self.folder} ({'; '.join(parts)})"


@dataclass
class Target:
    label: str
    reg: Registration
    size: int = 0  # the file's size before the signal


def _rows(run_dir: Path) -> list[dict]:
    try:
        rows = json.loads((run_dir / "roles.json").read_text())
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict) and "name" in r]


def on_slurm(run_dir: Path) -> bool:
    """The run's resolved config says cluster.kind=slurm (its roles are on other nodes)."""
    try:
        cfg = OmegaConf.load(run_dir / "config.yaml")
    except Exception:  # noqa: BLE001 -- unreadable: check_run_dir has said so already
        return False
    return OmegaConf.select(cfg, "cluster.kind", default=None) == "slurm"


def _label(reg: Registration, rows: list[dict]) -> str:
    """The role's name in roles.json where the registration maps to one by pid (local) or by
    its port (an engine registers as engine-<port>), else the name it registered with
    (trainer-rank0, trainer-agent)."""
    port = reg.role.rsplit("-", 1)[-1] if reg.role.startswith("engine-") else None
    for row in rows:
        same_pid = row.get("pid") == reg.pid and row.get("host") in (None, "127.0.0.1",
                                                                    reg.host)
        same_port = port is not None and str((row.get("ports") or {}).get("http")) == port \
            and str(row.get("host", "")).split(".")[0] == reg.host.split(".")[0]
        if (same_pid or same_port) and not reg.role.startswith(row["name"]):
            return row["name"]
    return reg.role


def _started(reg: Registration) -> float:
    try:
        return calendar.timegm(time.strptime(reg.started, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return 0.0


def _candidates(run_dir: Path, rows: list[dict], slurm: bool) -> list[Registration]:
    """The registrations that may be live processes of this attempt."""
    regs = registrations(run_dir)
    if slurm:  # pids live on other nodes: this attempt's (plan.json is written before it)
        try:
            since = (run_dir / "plan.json").stat().st_mtime - 1.0
        except OSError:
            since = 0.0
        return [r for r in regs if _started(r) >= since]
    pids = set()
    for row in rows:
        if isinstance(row.get("pid"), int) and Path(f"/proc/{row['pid']}").exists():
            pids.add(row["pid"])
            pids.update(descendants(row["pid"]))
    return [r for r in regs if r.pid in pids]


def _size(path: Path) -> int:
    try:
        with path.open("rb") as f:  # an open, not a stat: fresh on a shared filesystem
            return f.seek(0, os.SEEK_END)
    except OSError:
        return 0


def _signal_local(targets: list[Target]) -> list[Target]:
    sent = []
    for t in targets:
        try:
            os.kill(t.reg.pid, DUMP_SIGNAL)
            sent.append(t)
        except (ProcessLookupError, PermissionError):
            pass  # gone since: not a live role any more
    return sent


def slurm_kill_command(job_id: str, host: str, pids: list[int],
                       het_group: int | None = None) -> list[str]:
    """srun on `host` inside the run's job; in a het job, in the component that holds the
    node (srun answers "No directives to start application on any available hetjob
    components" without --het-group, and "Requested node configuration is not available" in
    the wrong one: tested on slurm 22.05)."""
    het = [] if het_group is None else [f"--het-group={het_group}"]
    return ["srun", f"--jobid={job_id}", *het, "--overlap", "--nodes=1", "--ntasks=1",
            f"--nodelist={host}", "--gpus-per-node=0", "--job-name=relax-dump",
            "sh", "-c", REMOTE_KILL, "relax-dump", *map(str, pids)]


def _het_group(info: dict, host: str) -> int | None:
    """The het-job component whose nodes include `host` (slurm.json's roles), None outside
    a het job."""
    if not info.get("het"):
        return None
    for role in (info.get("roles") or {}).values():
        if host in role.get("hosts", []):
            return int(role["het_group"])
    return 0


def _signal_slurm(run_dir: Path, targets: list[Target]) -> list[Target]:
    info = json.loads((run_dir / "slurm.json").read_text())
    job_id = str(info["job_id"])
    sent = []
    for host in sorted({t.reg.host for t in targets}):
        on_host = [t for t in targets if t.reg.host == host]
        try:
            out = subprocess.run(slurm_kill_command(job_id, host, [t.reg.pid for t in on_host],
                                                    _het_group(info, host)),
                                 capture_output=True, text=True, timeout=SRUN_TIMEOUT_S).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue  # nobody on that node signalled: named below as not answering
        signalled = {int(x) for x in out.split() if x.isdigit()}
        sent += [t for t in on_host if t.reg.pid in signalled]
    return sent


def _wait(targets: list[Target], wait_s: float) -> tuple[list[Target], list[Target]]:
    """(answered, silent): a file answered once it grew and then held its size for a poll (the
    handler writes in one go, but a loaded machine may pause it in the middle)."""
    deadline = time.monotonic() + wait_s
    last = {t.reg.path: t.size for t in targets}
    done: list[Target] = []
    while True:
        todo = [t for t in targets if t not in done]
        if not todo or time.monotonic() > deadline:
            return done, todo
        time.sleep(POLL_S)
        for t in todo:
            size = _size(t.reg.path)
            if size > t.size and size == last[t.reg.path]:
                done.append(t)
            last[t.reg.path] = size


def _folder(run_dir: Path) -> Path:
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    folder, n = run_dir / DIAGNOSTICS_DIR / stamp, 1
    while folder.exists():  # two dumps within a second
        folder, n = run_dir / DIAGNOSTICS_DIR / f"{stamp}-{n}", n + 1
    folder.mkdir(parents=True)
    return folder


def _copy(t: Target, folder: Path, asked: str) -> None:
    with t.reg.path.open("rb") as f:
        f.seek(t.size)
        text = f.read().decode(errors="replace")
    (folder / f"{t.label}.txt").write_text(
        f"# {t.label}: {t.reg.role} pid {t.reg.pid} on {t.reg.host}, sent {DUMP_SIGNAL.name} "
        f"at {asked}; its threads, most recent call first\n{text}")


def _unique(targets: list[Target]) -> None:
    seen: dict[str, int] = {}
    for t in targets:
        seen[t.label] = seen.get(t.label, 0) + 1
    for t in targets:
        if seen[t.label] > 1:
            t.label = f"{t.label}-{t.reg.pid}"


def dump_stacks(run_dir: Path, wait_s: float) -> Dump:
    """Signal every live registered process of the run, wait up to `wait_s` for each to write
    its stacks, and copy them into a new folder RUN_DIR/diagnostics/<UTC time>/."""
    run_dir = Path(run_dir)
    rows, slurm = _rows(run_dir), on_slurm(run_dir)
    targets = [Target(_label(r, rows), r, _size(r.path))
               for r in _candidates(run_dir, rows, slurm)]
    _unique(targets)
    asked = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sent = _signal_slurm(run_dir, targets) if slurm and targets else _signal_local(targets)
    answered, silent = _wait(sent, wait_s)
    silent += [t for t in targets if t not in sent]  # registered; the signal did not get there
    folder = _folder(run_dir)
    for t in answered:
        _copy(t, folder, asked)
    labels = [t.label for t in targets]
    missing = [r["name"] for r in rows
               if not any(x == r["name"] or x.startswith(r["name"] + "-") for x in labels)]
    dump = Dump(folder, sorted(t.label for t in answered), sorted(t.label for t in silent),
                missing, wait_s)
    (folder / "dump.json").write_text(json.dumps(dump.to_dict(), indent=2) + "\n")
    return dump
