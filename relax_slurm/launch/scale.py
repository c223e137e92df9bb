"""The launcher's part of elastic rollout (broker/elastic.py): it owns the processes, so it
starts the engines a scale-out asks for and stops those a scale-in or a rollback detached.

Called from the supervisor's watch loop (`Scaler.tick`, every POLL_S): one GET
/rollout/engines, then at most one short step, never a blocking wait:

- a PENDING scale-out: local mode starts `add` engine processes (the next free names and
  ports, `rollout.engine` like the launch's; restarted in place like them), external mode takes
  the URLs as given; both report CREATING (with the URLs) then HEALTH_CHECKING;
- HEALTH_CHECKING: once every new engine answers /health, report WEIGHT_SYNCING (trainer rank 0
  takes it from there); a process that died reports the op FAILED (rollback);
- detached engines: stop the processes it started, forget external ones; report `stopped`.

On Slurm (`jobs`, an `EngineJobs`) a `num_replicas` scale-out submits one Slurm job per new
engine instead (launch/engine_job.py): the op stays PENDING while the jobs wait in the queue
and start, and goes to CREATING once every engine has reported its URL; a job that ends before
its engine is healthy fails the op. Detached engines' jobs are cancelled (scale-in after its
drain, rollback), and `close` (the run's end) cancels every job still running. Engine jobs are
listed in roles.json (`kind: slurm_job`).

An engine job that ends while its engine serves (its time limit, a node failure, a scancel by
hand) is reported `lost` to the broker (broker/elastic.py: it leaves routing and the cohort at
once) and replaced: the Scaler asks for a scale-out back to the number of engines serving
before, as soon as no other operation runs. Each is a `replaced` row in restarts.jsonl, and an
engine restarted inside its job an `in_job` row; both count in summary.json's `restarts`.

An external engine (registered by URL) that does not answer /server_info for
cluster.restart.heartbeat_timeout_s is reported lost too (a `lost` row), and not replaced: the
run did not start it and cannot start another.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from relax_slurm.broker.heartbeat import Pacer
from relax_slurm.config import TrainConfig
from relax_slurm.errors import EngineError
from relax_slurm.launch.engine_job import EngineJobs
from relax_slurm.runtime.ports import free_port
from relax_slurm.launch.processes import ProcessSet, Role
from relax_slurm.launch.records import record_restart, write_roles
from relax_slurm.launch.restart import InPlace
from relax_slurm.launch.roles import engine_api_key, engine_spec, engines_rejoin
from relax_slurm.engines.client import EngineClient, probe_alive

log = logging.getLogger(__name__)
HTTP_TIMEOUT_S = 5.0
HEALTH_PROBE_S = 2.0
EXTERNAL_PROBE_S = 5.0  # how often external engines' /health is asked


class Scaler:
    def __init__(self, procs: ProcessSet, cfg: TrainConfig, run_dir: Path, admin: str,
                 secret: str, wrap: Any, host: str = "127.0.0.1",
                 in_place: InPlace | None = None, jobs: EngineJobs | None = None) -> None:
        self.procs, self.cfg, self.run_dir, self.wrap, self.host = procs, cfg, run_dir, wrap, host
        self.in_place = in_place
        self.jobs = jobs
        self.submitted: dict[str, list[str]] = {}  # scale-out id -> engine jobs not yet CREATING
        self.job_urls: dict[str, str] = {}  # url -> name of the engine job serving it
        self.admin = admin
        self.http = httpx.Client(timeout=HTTP_TIMEOUT_S,
                                 headers={"Authorization": f"Bearer {secret}"})
        # engines in service are probed on /server_info (answered paused: launch/health.py)
        # with the engines' key: the run's secret unless the user set RELAX_ENGINE_API_KEY
        self.engine_probe = httpx.Client(timeout=HEALTH_PROBE_S, headers={
            "Authorization": f"Bearer {engine_api_key(secret)}"})
        self.started: dict[str, Role] = {}  # url -> the engine process this launcher started
        self.replacing = 0  # engines lost with their jobs, not yet asked back by a scale-out
        self.restarted: dict[str, int] = {}  # engine job name -> restarts (replaced, in job)
        self._in_job_seen: dict[str, int] = {}  # engine job name -> in-job restarts recorded
        self._silent_since: dict[str, float] = {}  # external engine url -> first failed probe
        lost_after = cfg.cluster.restart.heartbeat_timeout_s
        self._probe = Pacer(min(EXTERNAL_PROBE_S, lost_after / 2)) if lost_after else None

    def close(self) -> None:
        """The run's end: cancel every engine job submitted (none stays in the queue)."""
        self.http.close()
        self.engine_probe.close()
        if self.jobs is not None:
            for name in list(self.jobs.jobs):
                self._record_in_job_restarts(name)
            self.jobs.cancel_all()

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(self.admin + route, json=body)
        if r.status_code >= 400:
            raise EngineError(f"POST {route}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def tick(self) -> None:
        """One look at the broker's engine list and one step (see above). A broker that does
        not answer now is asked again next tick (its restart is the supervisor's business)."""
        try:
            view = self.http.get(self.admin + "/rollout/engines").json()
            if self.jobs is not None:
                self._replace(view)
                self._watch_jobs(view)
            self._watch_external(view)
            for e in view["engines"]:
                if e["state"] == "detached":
                    self._stop(e["url"])
            op = view.get("op")
            self._forget_submitted(op)
            if op and op["kind"] == "scale_out":
                self._advance(op)
        except httpx.HTTPError as e:  # the broker restarting: HangWatch watches that
            log.debug("elastic rollout: broker admin HTTP: %s (trying again)", e)
        except (ValueError, KeyError, EngineError) as e:
            log.warning("elastic rollout: %s (trying again)", e)

    def _advance(self, op: dict[str, Any]) -> None:
        rid = op["request_id"]
        step = f"/rollout/ops/{rid}/step"
        if op["status"] == "PENDING":
            if op["mode"] == "local" and self.cfg.cluster.kind != "local":
                if self.jobs is None:
                    self._post(step, {"error": "num_replicas scale-outs need the launcher to "
                                               "start engines, which it cannot here; start the "
                                               "servers yourself and register them with "
                                               "engine_urls"})
                    return
                urls = self._job_urls(op)
                if urls is None:
                    return  # the jobs are queued or starting
            elif op["mode"] == "local":
                try:
                    urls = self._start_engines(op["add"])
                except Exception as e:  # noqa: BLE001 (report it, do not kill the run)
                    self._post(step, {"error": f"starting engines failed: {e}"})
                    return
            else:
                urls = op["urls"]
            got = self._post(step, {"status": "CREATING", "urls": urls})
            self.submitted.pop(rid, None)
            if got["status"] in ("CANCELLED", "FAILED"):  # cancelled while they started
                for url in urls if op["mode"] == "local" else []:
                    self._stop_process(url)
                    self._cancel_job(url)
                return
            self._post(step, {"status": "HEALTH_CHECKING"})
            self._say(f"{rid}: {len(urls)} engine(s) starting at {urls}")
        elif op["status"] == "HEALTH_CHECKING":
            for url in op["urls"]:
                role = self.started.get(url)
                if role is not None and role.proc.poll() is not None:
                    self._post(step, {"error": f"{role.name} exited with code "
                                               f"{role.proc.returncode}; see {role.log}"})
                    return
                name = self.job_urls.get(url)
                if name is not None and self.jobs is not None and self.jobs.ended(name):
                    self._post(step, {"error": f"the Slurm job of {name} ended before it was "
                                               f"healthy; see {self.run_dir / 'logs'}/{name}.log"})
                    return
                if not _healthy(url):
                    return
            self._post(step, {"status": "WEIGHT_SYNCING"})
            self._say(f"{rid}: engines healthy; the trainer sends them the weights")

    def _job_urls(self, op: dict[str, Any]) -> list[str] | None:
        """Slurm: submit the op's engine jobs (first call), then their URLs once every job has
        reported one (None until then). A job that ended without one fails the op."""
        assert self.jobs is not None
        rid = op["request_id"]
        names = self.submitted.get(rid)
        if names is None:
            names = self.submitted[rid] = self._new_names(op["add"])
            try:
                for name in names:
                    self.jobs.submit(name, self.cfg.seed + int(name.removeprefix("engine")))
            except Exception as e:  # noqa: BLE001 (report it, do not kill the run)
                self._post(f"/rollout/ops/{rid}/step",
                           {"error": f"submitting the engine jobs failed: {e}"})
                return None  # _forget_submitted cancels what was submitted
            ids = [self.jobs.jobs[n].job.job_id for n in names]
            self._say(f"{rid}: submitted Slurm job(s) {ids} for {names}")
            return None
        urls = [self.jobs.url(n) for n in names]
        for name, url in zip(names, urls):
            if url is None and self.jobs.ended(name):
                self._post(f"/rollout/ops/{rid}/step",
                           {"error": f"the Slurm job of {name} ended before it reported its "
                                     f"URL; see {self.run_dir / 'logs'}/{name}.log"})
                return None
        if any(u is None for u in urls):
            return None
        self.job_urls.update(zip(urls, names))  # (submitted until CREATING is on record)
        for name, url in zip(names, urls):
            info = self.jobs.info(name)
            self.procs.outside[name] = {
                "name": name, "kind": "slurm_job", "job_id": str(self.jobs.jobs[name].job.job_id),
                "url": url, "host": info.get("host"),
                "log": str(self.run_dir / "logs" / f"{name}.log"), "restarts": 0}
        write_roles(self.procs, self.run_dir)
        return urls

    def _watch_jobs(self, view: dict[str, Any]) -> None:
        """Engine jobs of engines in service: restarts inside them are recorded; one whose job
        ended is reported lost and a replacement is due (see the module's docstring)."""
        assert self.jobs is not None
        for e in view["engines"]:
            name = self.job_urls.get(e["url"])
            if name is None or name not in self.jobs.jobs or e["state"] not in ("active",
                                                                               "draining"):
                continue
            self._record_in_job_restarts(name)
            if not self.jobs.ended(name):
                continue
            why = f"its Slurm job {self.jobs.jobs[name].job.job_id} ended"
            self._post("/rollout/engines/lost", {"url": e["url"], "why": why})
            self.procs.outside.pop(name, None)
            write_roles(self.procs, self.run_dir)
            replace = e["state"] == "active"  # a draining one was on its way out anyway
            if replace:
                self.replacing += 1
                self.restarted[name] = self.restarted.get(name, 0) + 1
            record_restart(self.run_dir, {"role": name, "kind": "replaced" if replace else
                                          "lost", "restart": self.restarted.get(name, 0),
                                          "cause": why})
            self._say(f"{name} ({e['url']}): {why} while it served; "
                      + ("a new engine job replaces it" if replace else "it was draining"))

    def _watch_external(self, view: dict[str, Any]) -> None:
        """External engines in service that have not answered /server_info for
        cluster.restart.heartbeat_timeout_s (asked every EXTERNAL_PROBE_S at most) are reported
        lost."""
        external = {e["url"]: e for e in view["engines"]
                    if e["origin"] == "external" and e["state"] in ("active", "draining")}
        for url in [u for u in self._silent_since if u not in external]:
            del self._silent_since[url]
        if self._probe is None or not external or not self._probe.due():
            return
        lost_after = self.cfg.cluster.restart.heartbeat_timeout_s
        for url, e in external.items():
            if probe_alive(self.engine_probe, url):
                self._silent_since.pop(url, None)
                continue
            now = time.monotonic()
            silent = now - self._silent_since.setdefault(url, now)
            if silent < lost_after:
                continue
            why = (f"no answer to /server_info for {silent:.0f}s "
                   f"(cluster.restart.heartbeat_timeout_s={lost_after:g})")
            self._post("/rollout/engines/lost", {"url": url, "why": why})
            del self._silent_since[url]
            record_restart(self.run_dir, {"role": e["name"], "kind": "lost", "restart": 0,
                                          "url": url, "cause": why})
            self._say(f"{e['name']} ({url}, external): {why}; it leaves the run (not "
                      "replaced: the run did not start it)")

    def _record_in_job_restarts(self, name: str) -> None:
        assert self.jobs is not None
        n = int(self.jobs.info(name).get("restarts", 0))
        seen = self._in_job_seen.get(name, 0)
        if n > seen:
            self._in_job_seen[name] = n
            self.restarted[name] = self.restarted.get(name, 0) + n - seen
            record_restart(self.run_dir, {"role": name, "kind": "in_job", "restart": n,
                                          "cause": "exited; restarted inside its Slurm job"})
            if name in self.procs.outside:
                self.procs.outside[name]["restarts"] = n
                write_roles(self.procs, self.run_dir)

    def _replace(self, view: dict[str, Any]) -> None:
        """Ask for the engines lost with their jobs back, once no operation runs."""
        if not self.replacing or view.get("op") is not None:
            return
        serving = sum(e["state"] in ("joining", "active") for e in view["engines"])
        r = self.http.post(self.admin + "/rollout/scale_out",
                           json={"num_replicas": serving + self.replacing})
        if r.status_code == 409:
            return  # an operation started meanwhile: after it
        if r.status_code >= 400:  # e.g. above cluster.elastic.max_engines: asked once only
            self._say(f"the {self.replacing} engine(s) lost with their jobs are not replaced: "
                      f"POST /rollout/scale_out: HTTP {r.status_code}: {r.text[:300]}")
        else:
            self._say(f"replacing {self.replacing} engine(s) lost with their jobs: "
                      f"{r.json().get('request_id') or r.json().get('message')}")
        self.replacing = 0

    def counts(self) -> dict[str, int]:
        """Restarts of engine jobs' engines, by name: replaced jobs and restarts inside one."""
        return dict(self.restarted)

    def _forget_submitted(self, op: dict[str, Any] | None) -> None:
        """Cancel the jobs of scale-outs that ended (timeout, cancel) while still PENDING."""
        live = op["request_id"] if op and op["status"] == "PENDING" else None
        for rid in [r for r in self.submitted if r != live]:
            for name in self.submitted.pop(rid):
                assert self.jobs is not None
                self.jobs.cancel(name)
            self._say(f"{rid}: ended before its engines reported; their jobs are cancelled")

    def _new_names(self, n: int) -> list[str]:
        taken = {r.name for r in self.procs.roles} | (self.jobs.names_used if self.jobs else set())
        names = []
        for _ in range(n):
            k = next(i for i in range(len(taken) + n + 1) if f"engine{i}" not in taken)
            taken.add(f"engine{k}")
            names.append(f"engine{k}")
        return names

    def _start_engines(self, n: int) -> list[str]:
        taken = {r.name for r in self.procs.roles}
        urls = []
        for _ in range(n):
            k = next(i for i in range(len(taken) + n + 1) if f"engine{i}" not in taken)
            name = f"engine{k}"
            taken.add(name)
            url = f"http://{self.host}:{free_port(self.host)}"
            # restarted in place like the launch's engines when it dies (the trainer re-sends
            # the weights to it, see weightsync/cohort.py): a dead added engine must not fail
            # the run
            spec = engine_spec(self.cfg, name, url, self.cfg.model.path, self.cfg.seed + k,
                                slot=k, restartable=engines_rejoin(self.cfg))
            role = self.procs.start(name, self.wrap(spec), ports=spec.ports, host=spec.host,
                                    cpus=spec.cpus)
            if self.in_place is not None and spec.restart_argv is not None:
                self.in_place.specs[name] = spec
            self.started[url] = role
            urls.append(url)
        write_roles(self.procs, self.run_dir)
        return urls

    def _stop(self, url: str) -> None:
        self._stop_process(url)
        self._cancel_job(url)
        self._post("/rollout/engines/stopped", {"url": url})

    def _cancel_job(self, url: str) -> None:
        name = self.job_urls.pop(url, None)
        if name is not None and self.jobs is not None and name in self.jobs.jobs:
            entry = self.jobs.jobs[name]
            self._record_in_job_restarts(name)
            self.jobs.cancel(name)
            if self.procs.outside.pop(name, None) is not None:
                write_roles(self.procs, self.run_dir)
            if not entry.ended:
                self._say(f"cancelled the Slurm job {entry.job.job_id} of {name} ({url})")

    def _stop_process(self, url: str) -> None:
        role = self.started.pop(url, None)
        if role is not None and role in self.procs.roles:
            if self.in_place is not None:
                self.in_place.specs.pop(role.name, None)
            self.procs.stop(role)
            write_roles(self.procs, self.run_dir)
            self._say(f"stopped {role.name} ({url})")

    def _say(self, line: str) -> None:
        print(f"relax-train: elastic rollout: {line}", file=sys.stderr, flush=True)


def _healthy(url: str) -> bool:
    try:
        with EngineClient(url, HEALTH_PROBE_S) as client:
            client.health(timeout_s=HEALTH_PROBE_S)
        return True
    except EngineError:
        return False
