"""python pause_modes.py --model-dir D --out F

A weight sync's pause modes against a real hf engine, as SGLang 0.5.21+ treats its running
batch (weight_sync.pause_mode):
- retract, no update: a long seeded generation paused midway and continued draws the tokens of
  an uninterrupted run, and reports one retraction;
- retract across an update: the sequences keep their tokens and continue on the new weights;
  their version spans (meta_info.weight_versions) name both versions;
- abort: the running sequences end with finish_reason abort and the tokens they had;
- in_place: the sender refuses the mode when it connects; forced by hand, the update's cache
  flush is refused with SGLang's message, the weights being loaded all the same.
JSON to --out.
"""

import itertools
import json
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import free_port, perturbed, script_engine  # noqa: E402

from relax_slurm.errors import WeightSyncError  # noqa: E402
from relax_slurm.engines.client import EngineClient  # noqa: E402
from relax_slurm.weightsync import WeightSender  # noqa: E402

ROWS, MAX_NEW = 16, 400  # long enough that a pause lands midway (the tiny model has 512 positions)
PROMPT = [4, 5, 13, 6, 14]
PARAMS = [{"max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True,
           "sampling_seed": 1000 + i} for i in range(ROWS)]
ATTEMPTS = 3  # a pause that comes after the batch already ended is tried again


def status(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def generate_async(client: EngineClient) -> Future:
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(client.generate([PROMPT] * ROWS, PARAMS))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)
    threading.Thread(target=run, daemon=True).start()
    return fut


def while_generating(url: str, client: EngineClient, act) -> list | None:
    """Start the long generation, call act() once it runs (a few tokens in), return the
    results; None when the batch ended before act() could interrupt it."""
    fut = generate_async(client)
    deadline = time.monotonic() + 120
    while status(url)["running_tokens"] < 2 * ROWS:
        assert time.monotonic() < deadline and not fut.done(), "the generation never ran"
        time.sleep(0.005)
    act()
    results = fut.result(timeout=300)
    if all(r.meta_info.get("num_retractions", 0) == 0 and r.finish_reason != "abort"
           for r in results):
        return None
    return results


def attempt(url: str, client: EngineClient, act) -> list:
    for _ in range(ATTEMPTS):
        results = while_generating(url, client, act)
        if results is not None:
            return results
    raise AssertionError(f"no pause landed in a running batch in {ATTEMPTS} attempts")


def spans(results: list) -> list:
    return [[list(s) for s in r.weight_versions] for r in results]


def main() -> None:
    with script_engine() as eng:
        named, url, client, out = eng.named, eng.url, eng.client, eng.out
        new = perturbed(named, 5)

        # retract without an update: the same tokens as an uninterrupted run
        straight = client.generate([PROMPT] * ROWS, PARAMS)

        def pause_and_continue() -> None:
            client.pause_generation("retract")
            s = status(url)
            out["retracted_status"] = [s["running_sequences"], s["queued_sequences"]]
            client.continue_generation()
        retracted = attempt(url, client, pause_and_continue)
        out["retract_same_tokens"] = [r.output_ids for r in retracted] == \
            [r.output_ids for r in straight]
        out["retract_logprob_gap"] = max(abs(a - b) for r, s in zip(retracted, straight)
                                         for a, b in zip(r.logprobs, s.logprobs))
        out["retract_retractions"] = sorted({r.meta_info["num_retractions"] for r in retracted})
        out["retract_spans"] = spans(retracted)

        # in_place: refused by the protocol check
        try:
            WeightSender([url], "127.0.0.1", free_port(), "relax_test_inplace", "gloo", 60, 512,
                         pause_mode="in_place").connect()
            out["in_place_error"] = None
        except WeightSyncError as e:
            out["in_place_error"] = str(e)

        # retract across an update: the sync pauses, updates, continues
        sender = WeightSender([url], "127.0.0.1", free_port(), "relax_test_pause", "gloo", 60,
                              512, pause_mode="retract")
        sender.connect()
        versions = itertools.count(1)  # a new one per attempt: a retried sync must change it
        across = attempt(url, client, lambda: sender.send(new, version=next(versions)))
        out["across_spans"] = spans(across)
        out["across_versions"] = sorted({tuple(r.versions()) for r in across})
        out["across_lengths"] = sorted({len(r.output_ids) for r in across})

        # abort: the running batch ends with what it has
        sender.pause_mode = "abort"
        aborted = attempt(url, client, lambda: sender.send(named, version=next(versions)))
        out["abort_reasons"] = sorted({json.dumps(r.meta_info["finish_reason"]) for r in aborted})
        out["abort_lengths_ok"] = all(0 < len(r.output_ids) < MAX_NEW for r in aborted)
        out["abort_after"] = [r.finish_reason for r in
                              client.generate([PROMPT], [PARAMS[0]])]  # serving again

        # in_place forced by hand: the update's flush finds the held rows
        sender.pause_for_sync = False

        def held_then_update() -> None:
            client.pause_generation("in_place")
            out["held"] = status(url)["held_in_place"]
            try:
                sender.send(new, version=next(versions))
                out["flush_error"] = None
            except WeightSyncError as e:
                out["flush_error"] = str(e)
            sender.verify(new)  # loaded all the same
            out["loaded_despite_flush"] = True
            client.continue_generation()
        held = attempt(url, client, held_then_update)
        out["held_spans_versions"] = sorted({tuple(r.versions()) for r in held})
        last = next(versions)
        sender.send(named, version=last)  # the session the failure left open is recovered
        out["recovered_version"] = [client.weight_version(), str(last)]
        sender.close()


if __name__ == "__main__":
    main()
