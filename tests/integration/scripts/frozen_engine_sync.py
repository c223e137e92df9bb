"""python frozen_engine_sync.py --model-dir D --out F [--url URL --pid PID]

A sync whose engine never receives (issue #35/#34): trainer rank 0's side sends to two engines,
and engine 1 is frozen (SIGSTOP to its process group) just before a bucket's broadcast. The send
must raise WeightSyncError within weight_sync.timeout_s (not wait silently), naming the frozen
engine (index and URL) and the version, and not the engine that received. Then the engine is let
go and the cohort re-formed on a new group, as a run's recovery does: both engines take the
resend and report its version. JSON to --out.

Engine 0 is an hf engine of the script's own; engine 1 is another one, or with --url/--pid the
engine under test (the real SGLang: its scheduler, which receives, is a child of PID, hence the
process group). RELAX_ENGINE_API_KEY, when set, is the engines' key.

Three clocks run timeout_s against a frozen engine: the sender's wait, gloo's own timeout and
the engine call's HTTP timeout; whichever ends first, the error names the engine. Env FIRST
(wait, group or http) picks the one that runs TIMEOUT_S while the other two run three times it.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import free_port, start_engine, stop_process, wait_healthy  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from relax_slurm.engines.client import EngineClient, wait_until_healthy  # noqa: E402
from relax_slurm.errors import WeightSyncError  # noqa: E402
from relax_slurm.weightsync import WeightSender  # noqa: E402

TIMEOUT_S = 8.0
RECOVERY_S = 120.0
"""The re-formed cohort's wait and timeout: the thawed engine first ends its failed receive."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--url", help="engine 1, the one frozen (default: an hf engine of its own)")
    p.add_argument("--pid", type=int, help="the leader of engine 1's process group")
    args = p.parse_args()
    named = list(load_file(str(args.model_dir / "model.safetensors")).items())
    key = os.environ.get("RELAX_ENGINE_API_KEY")
    own, urls = [], []
    for i in range(1 if args.url else 2):
        port, log = free_port(), args.out.with_suffix(f".engine{i}.log")
        own.append((start_engine(args.model_dir, port, log, api_key=key), log))
        urls.append(f"http://127.0.0.1:{port}")
    frozen_pgid = args.pid if args.url else own[1][0].pid
    if args.url:
        urls.append(args.url)
    out: dict = {"timeout_s": TIMEOUT_S, "urls": urls}
    thawed = False

    def thaw() -> None:
        nonlocal thawed
        if not thawed:
            thawed = True
            os.killpg(frozen_pgid, signal.SIGCONT)

    try:
        for url, (proc, log) in zip(urls, own):
            wait_healthy(url, proc, 180, log)
        first = os.environ["FIRST"]
        # gloo's timeout is fixed when the group forms; the other two are read at each call
        sender = WeightSender(urls, "127.0.0.1", free_port(), "relax_test_frozen_c0", "gloo",
                              TIMEOUT_S if first == "group" else 3 * TIMEOUT_S, 512,
                              pause_for_sync=False)
        sender.connect()
        sender.timeout_s = TIMEOUT_S if first == "wait" else 3 * TIMEOUT_S
        for c in sender.clients:
            c.timeout_s = TIMEOUT_S if first == "http" else 3 * TIMEOUT_S
        sender.send([(n, t + 0.25) for n, t in named], version=1)  # a healthy sync first
        send_bucket = sender._send_bucket

        def freeze_then_send(*a, **kw):
            os.killpg(frozen_pgid, signal.SIGSTOP)  # alive, silent: never joins the broadcast
            return send_bucket(*a, **kw)

        sender._send_bucket = freeze_then_send
        t0 = time.monotonic()
        try:
            sender.send([(n, t + 0.5) for n, t in named], version=2)
            out["error"] = None
        except WeightSyncError as e:
            out["error"] = str(e)
        out["failed_after_s"] = time.monotonic() - t0
        thaw()
        # the cohort re-formed as the trainer's recovery does (Cohort.reform): wait for both
        # (a failed sync may leave them paused), a new group, the old one destroyed, a resend
        wait_until_healthy(urls, RECOVERY_S, paused_ok=True)
        resend = WeightSender(urls, "127.0.0.1", free_port(), "relax_test_frozen_c1", "gloo",
                              RECOVERY_S, 512)
        resend.connect()
        for u in urls:
            with EngineClient(u, 30.0) as c:
                c.destroy_weights_update_group("relax_test_frozen_c0")
        sender.close()
        resend.send(named, version=3)  # the model's own: an engine under test serves it on
        out["versions_after_resend"] = []
        for u in urls:
            with EngineClient(u, 30.0) as c:
                out["versions_after_resend"].append(c.weight_version())
        resend.destroy_on_engines()
        resend.close()
    finally:
        thaw()
        for proc, _ in own:
            stop_process(proc)
        args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
