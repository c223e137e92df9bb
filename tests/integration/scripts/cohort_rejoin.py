"""python cohort_rejoin.py --model-dir D --out F

Trainer rank 0's side of an engine restart, alone: start an hf engine, form the weight-sync
cohort, send weights at version 3; SIGKILL the engine and start a new one on its port (what the
launcher does); `Cohort.resync` must see it unreachable, then stale (version 0), then re-form
the cohort and send the weights, which the new engine then holds bit for bit. Then a second
engine joins (`move`) and is SIGKILLed for good, and the broker's engine set (`follow`) no
longer has it (the launcher reported it lost): the next send re-forms the cohort with the
survivor instead of waiting for the dead one; that send is a stream, which cannot be sent twice:
it is read to its end and the caller is asked for another. JSON to --out.
"""

import json
import os
import signal
import sys
import threading
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import (free_port, script_args, start_engine, stop_process,  # noqa: E402
                          wait_healthy)

from relax_slurm.weightsync import WeightSender  # noqa: E402
from relax_slurm.weightsync.cohort import Cohort, ResendNeeded  # noqa: E402


def main() -> None:
    model_dir, named, out_path = script_args()
    g = torch.Generator().manual_seed(3)
    weights = [(n, t + 0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype)) for n, t in named]
    port, log = free_port(), out_path.with_suffix(".engine.log")
    url = f"http://127.0.0.1:{port}"
    engine = start_engine(model_dir, port, log)
    out = {}
    try:
        wait_healthy(url, engine, 180, log)

        def make_sender(name: str, sync_port: int, urls: list[str]) -> WeightSender:
            return WeightSender(urls, "127.0.0.1", sync_port, name, "gloo", 60, 0.02,
                                pause_for_sync=False)
        cohort = Cohort([url], "relax_test_cohort", free_port(), make_sender, free_port, 180)
        cohort.connect()
        cohort.send(weights, version=3)
        out["stale_before"] = cohort.stale(3)
        out["resync_before"] = cohort.resync(lambda: weights, 3)

        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(30)
        out["stale_dead"] = cohort.stale(3)
        engine = start_engine(model_dir, port, log)  # restarted in place
        wait_healthy(url, engine, 180, log)
        out["stale_restarted"] = cohort.stale(3)
        out["resync_restarted"] = cohort.resync(lambda: weights, 3)
        out["generation"] = cohort.generation
        out["stale_after"] = cohort.stale(3)
        cohort.sender.verify(weights)  # raises unless bit for bit
        out["verified"] = True

        # the engine dies between a send and its check (weight_sync.verify): the check waits
        # for it like a failed send (the launcher restarts it), re-forms, sends, checks again
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(30)
        waiting = threading.Event()
        cohort.waiting = waiting.set  # called between health polls: the check has failed
        checked: dict = {}
        thread = threading.Thread(target=lambda: checked.update(
            ok=cohort.verify(weights, 3) is None), daemon=True)
        thread.start()
        assert waiting.wait(120), "the check did not wait for the engine"
        engine = start_engine(model_dir, port, log)  # restarted in place
        thread.join(240)
        out["verify_after_kill"] = [checked.get("ok", False), cohort.generation]
        cohort.waiting = lambda: None

        port_b = free_port()
        url_b = f"http://127.0.0.1:{port_b}"
        engine_b = start_engine(model_dir, port_b, log.with_suffix(".b.log"))
        try:
            wait_healthy(url_b, engine_b, 180, log.with_suffix(".b.log"))
            cohort.move([url, url_b])
            # the replaced cohort's group is destroyed on the engine that had it
            out["groups_after_move"] = httpx.get(url + "/server_info").json()[
                "weight_update_groups"]
            cohort.send(weights, version=3)
            os.kill(engine_b.pid, signal.SIGKILL)
            engine_b.wait(30)
        finally:
            stop_process(engine_b)
        # what the broker answers once the launcher reported engine B lost
        cohort.follow = lambda: [url]
        cohort.startup_timeout_s = 30  # waiting for the dead engine would raise EngineDown
        later = [(n, t + 1.0) for n, t in weights]
        # streamed (the trainer's export read as it is gathered): the failed send reads it
        # to its end, re-forms, and asks for another export, which then goes to the new cohort
        read = []
        try:
            cohort.send((read.append(n) or (n, t) for n, t in later), version=4)
            out["resend_needed"] = None
        except ResendNeeded as e:
            out["resend_needed"] = str(e)
        out["stream_read"] = len(read) == len(later)
        cohort.send(iter(later), version=4)
        out["followed"] = cohort.urls
        cohort.sender.verify(later)
        out["verified_after_loss"] = True
        out["groups_after_loss"] = httpx.get(url + "/server_info").json()["weight_update_groups"]
        cohort.close()
    finally:
        stop_process(engine)
        out_path.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
