"""python frozen_engine_sync.py --model-dir D --out F

A sync whose engine never receives (issue #35/#34): trainer rank 0's side sends to two real hf
engines, and one of them is frozen (SIGSTOP) just before a bucket's broadcast. The send must
raise WeightSyncError within weight_sync.timeout_s (not wait silently), naming the frozen
engine (index and URL) and the version, and not the engine that received. JSON to --out.

Three clocks run timeout_s against a frozen engine: the sender's wait, gloo's own timeout and
the engine call's HTTP timeout; whichever ends first, the error names the engine. Env FIRST
(wait, group or http) picks the one that runs TIMEOUT_S while the other two run three times it.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import (free_port, script_args, start_engine, stop_process,  # noqa: E402
                          wait_healthy)

from relax_slurm.errors import WeightSyncError  # noqa: E402
from relax_slurm.weightsync import WeightSender  # noqa: E402

TIMEOUT_S = 8.0


def main() -> None:
    model_dir, named, out_path = script_args()
    weights = [(n, t + 0.25) for n, t in named]
    engines, urls = [], []
    out = {"timeout_s": TIMEOUT_S}
    try:
        for i in range(2):
            port, log = free_port(), out_path.with_suffix(f".engine{i}.log")
            engines.append((start_engine(model_dir, port, log), log))
            urls.append(f"http://127.0.0.1:{port}")
        for url, (proc, log) in zip(urls, engines):
            wait_healthy(url, proc, 180, log)
        first = os.environ["FIRST"]
        # gloo's timeout is fixed when the group forms; the other two are read at each call
        sender = WeightSender(urls, "127.0.0.1", free_port(), "relax_test_frozen", "gloo",
                              TIMEOUT_S if first == "group" else 3 * TIMEOUT_S, 512,
                              pause_for_sync=False)
        sender.connect()
        sender.timeout_s = TIMEOUT_S if first == "wait" else 3 * TIMEOUT_S
        for c in sender.clients:
            c.timeout_s = TIMEOUT_S if first == "http" else 3 * TIMEOUT_S
        sender.send(weights, version=1)  # a healthy sync first
        frozen = engines[1][0]
        send_bucket = sender._send_bucket

        def freeze_then_send(*args, **kwargs):
            os.kill(frozen.pid, signal.SIGSTOP)  # alive, silent: never joins the broadcast
            return send_bucket(*args, **kwargs)

        sender._send_bucket = freeze_then_send
        t0 = time.monotonic()
        try:
            sender.send(weights, version=2)
            out["error"] = None
        except WeightSyncError as e:
            out["error"] = str(e)
        out["failed_after_s"] = time.monotonic() - t0
        out["urls"] = urls
        os.kill(frozen.pid, signal.SIGCONT)
        sender.close()
    finally:
        for proc, _ in engines:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            stop_process(proc)
        out_path.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
