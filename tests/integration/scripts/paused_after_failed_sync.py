"""python paused_after_failed_sync.py --model-dir D --out F --url URL

A sync that fails midway leaves the engines paused until the resend (issue #33): trainer rank 0's
side sends to the engine at URL (real SGLang or an hf engine, started by the test, paused by
nothing yet) and to an hf engine of its own, which is frozen (SIGSTOP) after the first bucket.
The send fails at weight_sync.timeout_s; every HTTP call the failed sender made has then
finished, and the engine at URL must still be paused (GET /ready 503: some of its weights are
new, its label is the old version). Then the frozen engine is let go, the cohort re-formed on a
new group (the wait accepts paused engines) and the weights resent: the engine takes requests
again and serves version 2. JSON to --out.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import (engine_script_args, free_port, start_engine,  # noqa: E402
                          stop_process, wait_healthy)
from safetensors.torch import load_file  # noqa: E402

from relax_slurm.engines.client import EngineClient, wait_until_healthy  # noqa: E402
from relax_slurm.errors import WeightSyncError  # noqa: E402
from relax_slurm.weightsync import WeightSender  # noqa: E402

TIMEOUT_S = 8.0


def main() -> None:
    args = engine_script_args()
    named = list(load_file(str(args.model_dir / "model.safetensors")).items())
    weights = [(n, t + 0.25) for n, t in named]
    port, log = free_port(), args.out.with_suffix(".frozen.log")
    frozen = start_engine(args.model_dir, port, log, api_key=os.environ["RELAX_ENGINE_API_KEY"])
    urls = [args.url, f"http://127.0.0.1:{port}"]
    out: dict = {"timeout_s": TIMEOUT_S}
    client = EngineClient(args.url, 30.0)
    try:
        wait_healthy(urls[1], frozen, 180, log)
        out["ready_before"] = client.ready()
        # small buckets: the freeze comes after the first, with part of the weights loaded
        sender = WeightSender(urls, "127.0.0.1", free_port(), "relax_test_paused_c0", "gloo",
                              TIMEOUT_S, bucket_mb=0.05, pause_mode="retract")
        sender.connect()
        send_bucket, sent = sender._send_bucket, []

        def freeze_after_the_first(*a, **kw):
            if sent:
                os.kill(frozen.pid, signal.SIGSTOP)
            sent.append(1)
            return send_bucket(*a, **kw)

        sender._send_bucket = freeze_after_the_first
        try:
            sender.send(weights, version=1)
            out["error"] = None
        except WeightSyncError as e:
            out["error"] = str(e)
        out["buckets_begun"] = len(sent)
        sender._pool.shutdown(wait=True)  # every call the failed sync made has answered
        out["ready_after_failure"] = client.ready()
        out["version_after_failure"] = client.weight_version()
        os.kill(frozen.pid, signal.SIGCONT)
        # the cohort's re-forming: wait for both (paused ones included), a new group, resend
        t0 = time.monotonic()
        wait_until_healthy(urls, 60.0, paused_ok=True)
        out["waited_s"] = time.monotonic() - t0
        resend = WeightSender(urls, "127.0.0.1", free_port(), "relax_test_paused_c1", "gloo",
                              60.0, bucket_mb=0.05, pause_mode="retract")
        resend.connect()
        for u in urls:  # the old group, as Cohort.reform does (the old sender's pool is shut)
            with EngineClient(u, 30.0) as c:
                c.destroy_weights_update_group("relax_test_paused_c0")
        sender.close()
        resend.send(weights, version=2)
        out["ready_after_resend"] = client.ready()
        out["version_after_resend"] = client.weight_version()
        resend.destroy_on_engines()
        resend.close()
    finally:
        try:
            os.kill(frozen.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        stop_process(frozen)
        client.close()
        args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
