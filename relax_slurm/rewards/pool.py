"""Rewards in worker processes, with a concurrency cap and a per-call timeout.

    pool = RewardPool(max_workers=reward_workers(cfg.reward), timeout_s=cfg.reward.timeout_s)
    scored = await pool.score_many(build_reward(cfg.reward), inputs)  # [(value, error), ...]
    value, error = await pool.score(build_reward(cfg.reward), inp)  # one input

`score_many` sends a group's inputs to a worker in one message and gets one reply per input, so
a group costs one round trip per worker instead of one per sample; a large group is split
across up to `max_workers` workers. `timeout_s` still applies to each input, from when its
worker could start it (the previous input's result): a hanging input costs one timeout, its
worker is killed, and the inputs after it go on in a fresh worker.

A reward that raises, returns a non-number, hangs past `timeout_s` or kills its process scores
0.0 with `error=True` (count these in rollout/reward_errors); the run goes on. A reward that
cannot be sent to or rebuilt in a worker (unpicklable, not importable) or whose config is
wrong raises ConfigError instead: it would fail every sample.

Why processes and not threads: a thread cannot be stopped. A reward stuck in a pure-Python
loop (a pathological SymPy simplification, a regex with catastrophic backtracking) would hold
its thread forever, slowly using up the pool, and keep taking the GIL from the event loop that
drives generation. A process is killed at the timeout and replaced. Processes also run CPU-heavy
grading in parallel, and math-verify's own SIGALRM time limits only work in a main thread, which
each worker has. The cost is pickling each input (small next to generation) and a process
start-up per worker. Workers are forked from a `forkserver`: a small single-threaded process
that imported the rewards (and math-verify, with `warm_up`) once, so a worker, or the
replacement of a killed one, starts in milliseconds; forking the caller itself would be unsafe
once it holds torch, CUDA or asyncio threads. `start_method="spawn"` also works (slower starts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import multiprocessing as mp
import pickle
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from relax_slurm.errors import ConfigError, RelaxError

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
MAX_CACHED_FNS = 256  # reward objects a worker keeps (with their HTTP clients) between calls
PRELOAD = ["relax_slurm.rewards"]
SPLIT_ABOVE_S = 0.002  # a group is split across workers once its reward takes this per input


class _WorkerDied(Exception):
    pass


def _score_one(fn: Callable[[Any], float], inp: Any) -> tuple[str, Any]:
    """("ok", value), or ("error" | "config_error", message)."""
    try:
        value = float(fn(inp))
    except ConfigError as e:
        return "config_error", str(e)
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"
    return ("ok", value) if math.isfinite(value) else ("error", f"reward returned {value}")


def _worker_main(conn: Connection, warm_up: bool, sys_path: list[str]) -> None:
    """Worker loop: receive (key, fn or None, inputs), reply per input, in order, ("ok", value)
    or (kind, message); or one ("resend" | "config_error", ...) for the whole message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    sys.path[:] = sys_path  # the fork server's path dates from its start; custom rewards move
    import relax_slurm.rewards.built_in  # noqa: F401  (registers the built-in rewards)
    from relax_slurm.rewards.registry import Scorer

    if warm_up:  # seconds of SymPy imports belong to start-up, not to a timed first call
        from relax_slurm.rewards.math import warm_up as load_math_verify

        load_math_verify()

    fns: dict[int, Callable[[Any], float]] = {}
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # parent gone, or it closed our pipe (pool closing)
            return
        except Exception as e:  # could not unpickle what the parent sent
            conn.send(("config_error", f"cannot load the reward in a worker: {e!r}"))
            continue
        if msg is None:
            return
        key, fn, inputs = msg
        if fn is not None:
            if len(fns) >= MAX_CACHED_FNS:
                fns.clear()
            fns[key] = Scorer(fn) if isinstance(fn, str) else fn
        elif key not in fns:
            conn.send(("resend", None))
            continue
        for inp in inputs:  # a reply per input as it is done: the parent times each one
            reply = _score_one(fns[key], inp)
            conn.send(reply)
            if reply[0] == "config_error":  # the parent raises; the rest would fail alike
                break


class _Worker:
    def __init__(self, ctx: Any, warm_up: bool) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, warm_up, list(sys.path)),
                                daemon=True, name="relax-reward")
        self.proc.start()
        child.close()
        self.known: set[int] = set()  # fn keys this worker has received

    async def _readable(self, timeout_s: float) -> None:
        """Until a reply can be read; asyncio.TimeoutError after `timeout_s`."""
        if self.conn.poll():  # replies of a fast reward are often waiting already
            await asyncio.sleep(0)  # still a turn for the others (a group's other chunks)
            return
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        timer = loop.call_later(timeout_s, lambda: readable.done()
                                or readable.set_exception(asyncio.TimeoutError()))
        try:
            await readable
        finally:
            timer.cancel()
            loop.remove_reader(fd)

    def _read(self) -> Any:
        try:
            return self.conn.recv()
        except (EOFError, OSError) as e:
            raise _WorkerDied(f"reward worker exited (code {self.proc.exitcode})") from e

    async def replies(self, timeout_s: float) -> list[tuple[str, Any]]:
        """Every reply that has arrived, once at least one has (within `timeout_s`): a fast
        reward's replies are read in one turn of the event loop, not one wait each."""
        await self._readable(timeout_s)
        out = [self._read()]
        while self.conn.poll():
            try:
                out.append(self._read())
            except _WorkerDied:  # after replies it sent before dying: the next call says so
                break
        return out

    async def started(self) -> None:
        await self._readable(STARTUP_TIMEOUT_S)
        status, _ = self._read()
        assert status == "ready", status

    def send(self, key: int, fn: Any, inputs: list) -> None:
        """Inputs to score in order (fn along unless this worker has it already)."""
        # Connection.send pickles before writing: a pickling error leaves the pipe clean
        self.conn.send((key, None if key in self.known else fn, inputs))
        self.known.add(key)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5.0)
        self.conn.close()


class RewardPool:
    """At most `max_workers` rewards at once, each in a worker process, each within `timeout_s`.

    `warm_up` loads math-verify and SymPy before a worker takes its first call (a few seconds,
    once in the fork server), so that the first math grade is not cut by the timeout; turn it
    off for rewards that do not use them. `await pool.start()` starts every worker up front.
    """

    def __init__(self, max_workers: int, timeout_s: float, *, warm_up: bool = True,
                 start_method: str = "forkserver", split_above_s: float = SPLIT_ABOVE_S) -> None:
        if max_workers < 0 or timeout_s <= 0:
            raise ConfigError(f"reward pool: max_workers={max_workers} must be >= 0 and "
                              f"timeout_s={timeout_s} > 0 (reward.num_workers, reward.timeout_s)")
        self.max_workers, self.timeout_s, self.warm_up = max_workers, timeout_s, warm_up
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":  # takes effect if this process's server is not up yet
            self._ctx.set_forkserver_preload(PRELOAD + (["relax_slurm.rewards.warm"] if warm_up
                                                        else []))
        self._slots = asyncio.Semaphore(max_workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._keys: dict[int, tuple[int, Any]] = {}  # id(fn) -> (key, fn kept alive)
        self._next_key = itertools.count()
        self.calls = 0
        self.errors = 0
        self.busy = 0
        """Workers scoring now (their chunks hold a slot): what a stall note shows."""
        self.split_above_s = split_above_s
        self._per_input_s: dict[int, float] = {}  # key -> moving average of a chunk's s/input

    async def start(self) -> None:
        """Start every worker now, before the first call (optional: else on first use)."""
        while len(self._all) < self.max_workers:
            self._idle.append(await self._spawn())

    async def score(self, fn: Callable[[Any], float] | str, inp: Any) -> tuple[float, bool]:
        """(fn(inp), False), or (0.0, True) when fn raised, hung or died. `fn` must be picklable
        (a module-level function, a `Scorer`, ...) or a reward name."""
        return (await self.score_many(fn, [inp]))[0]

    async def score_many(self, fn: Callable[[Any], float] | str, inputs: list
                         ) -> list[tuple[float, bool]]:
        """`score` of each input, in order, in as few messages as possible: the inputs are split
        into at most `max_workers` contiguous chunks, each scored by one worker at a time."""
        if not inputs:
            return []
        if self.max_workers == 0:
            return self._score_inline(fn, inputs)
        key = self._key(fn)
        # a fast reward's group goes to one worker: splitting it costs more messages than the
        # parallel scoring saves (groups are scored concurrently anyway)
        split = (1 if self._per_input_s.get(key, math.inf) < self.split_above_s
                 else self.max_workers)
        size = -(-len(inputs) // min(split, len(inputs)))
        chunks = [inputs[i:i + size] for i in range(0, len(inputs), size)]
        if len(chunks) == 1:
            return await self._score_chunk(key, fn, chunks[0])
        tasks = [asyncio.ensure_future(self._score_chunk(key, fn, c)) for c in chunks]
        try:
            scored = await asyncio.gather(*tasks)
        except BaseException:  # a ConfigError fails the whole group: stop the other chunks
            for task in tasks:
                task.cancel()
                # whatever they end with (the pool may be closing under them) is moot now
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise
        return [result for chunk in scored for result in chunk]

    def _score_inline(self, fn: Callable[[Any], float] | str, inputs: list
                      ) -> list[tuple[float, bool]]:
        """max_workers=0: every input in this process, on the caller's thread. No timeout and
        no isolation, and none of the ~50 us a response of pickling and pipe round trips the
        workers cost (~30 ms for a step of 512 short responses on 2 loaded cores, against
        ~1 ms scored here): for pure, fast rule rewards."""
        from relax_slurm.rewards.registry import Scorer

        fn = Scorer(fn) if isinstance(fn, str) else fn
        self.calls += len(inputs)
        results = []
        for inp in inputs:
            status, payload = _score_one(fn, inp)
            if status == "config_error":
                raise ConfigError(payload)
            results.append((payload, False) if status == "ok" else self._fail(None, payload))
        return results

    async def _score_chunk(self, key: int, fn: Any, inputs: list) -> list[tuple[float, bool]]:
        """Inputs in order on one worker; after a timeout or death, the rest on a fresh one."""
        results: list[tuple[float, bool]] = []
        async with self._slots:
            start = time.perf_counter()
            self.calls += len(inputs)
            self.busy += 1
            try:
                while len(results) < len(inputs):
                    worker = self._idle.pop() if self._idle else await self._spawn()
                    if await self._run(worker, key, fn, inputs[len(results):], results):
                        self._idle.append(worker)
            finally:
                self.busy -= 1
            # the reward's cost per input as this pool sees it (round trip included)
            took = (time.perf_counter() - start) / len(inputs)
            known = self._per_input_s.get(key)
            self._per_input_s[key] = took if known is None else 0.8 * known + 0.2 * took
        return results

    async def _run(self, worker: _Worker, key: int, fn: Any, inputs: list,
                   results: list[tuple[float, bool]]) -> bool:
        """Append inputs' results from worker until one hangs or kills it (that one scores as an
        error and the worker is discarded: False); True when all are done and worker is idle."""
        try:
            worker.send(key, fn, inputs)
            done = len(results)
            while len(results) - done < len(inputs):
                # each input's clock starts at the previous result, when the worker took it up
                for status, payload in await worker.replies(self.timeout_s):
                    if status == "resend":  # the worker dropped fn from its cache
                        worker.known.discard(key)
                        worker.send(key, fn, inputs)
                    elif status == "config_error":
                        worker.known.discard(key)
                        raise ConfigError(payload)
                    else:
                        results.append((payload, False) if status == "ok"
                                       else self._fail(None, payload))
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # nothing was sent
            self._idle.append(worker)
            raise ConfigError(f"reward {fn!r} cannot be sent to a reward worker ({e}). Fix: "
                              "use a module-level function or a registered name") from e
        except ConfigError:  # the worker stopped at it and waits for the next message
            self._idle.append(worker)
            raise
        except asyncio.TimeoutError:
            results.append(self._fail(worker, f"no result within {self.timeout_s}s (killed)"))
            return False
        except _WorkerDied as e:
            results.append(self._fail(worker, str(e)))
            return False
        except BaseException:  # cancelled mid-call: the worker's state is unknown
            self._discard(worker)
            raise
        return True

    def load(self) -> dict[str, Any]:
        """Workers busy, of how many, and the slowest reward's seconds per response (moving
        average, round trip included; None before the first call): the worker's heartbeat."""
        per_input = max(self._per_input_s.values(), default=None)
        return {"busy": self.busy, "workers": self.max_workers,
                "s_per_response": None if per_input is None else round(per_input, 4)}

    def _key(self, fn: Any) -> int:
        """A number per reward object, so a worker receives each object once and keeps it."""
        if id(fn) not in self._keys or self._keys[id(fn)][1] is not fn:
            if len(self._keys) >= MAX_CACHED_FNS:  # callers making a new object per call
                self._keys.clear()
            self._keys[id(fn)] = (next(self._next_key), fn)
        return self._keys[id(fn)][0]

    async def _spawn(self) -> _Worker:
        # off the event loop: the first start waits for the fork server to import everything
        worker = await asyncio.to_thread(_Worker, self._ctx, self.warm_up)
        self._all.add(worker)
        try:
            await worker.started()
        except (asyncio.TimeoutError, _WorkerDied) as e:
            self._discard(worker)
            raise RelaxError(f"a reward worker did not start within {STARTUP_TIMEOUT_S}s: {e}. "
                             "Run `python -c 'import relax_slurm.rewards.built_in'` to see "
                             "why") from e
        return worker

    def _fail(self, worker: _Worker | None, message: str) -> tuple[float, bool]:
        if worker is not None:
            self._discard(worker)
        self.errors += 1
        if self.errors <= 10 or self.errors % 100 == 0:
            log.warning("reward error %d (of %d calls), scored 0: %s", self.errors, self.calls,
                        message)
        return 0.0, True

    def _discard(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Stop every worker (idle ones are asked to exit, busy ones are killed)."""
        for worker in list(self._all):
            if worker in self._idle:
                try:
                    worker.conn.send(None)
                    worker.proc.join(timeout=2.0)
                except (OSError, ValueError):
                    pass
            self._discard(worker)
        self._idle.clear()

    async def __aenter__(self) -> "RewardPool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
