"""/generate during a weight update waits for it (and is refused only if the update failed
midway, with 503: the worker tries again later): an engine restarted in place got the worker's
re-queued groups while it received its first weights, answered 400 "failed midway" and so
killed the rollout worker (seen on Slurm in tests/slurm/test_slurm_elastic.py and in a local
chaos run). The update is held here as `update_weights` holds it: the model lock taken, and
`state.partial_weights` set only if it fails."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from relax_slurm.engines.hf.core import HFEngine
from relax_slurm.engines.hf.server import build_app

pytestmark = pytest.mark.timeout(120)
BODY = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}}


def held_update(engine: HFEngine, http: TestClient, fails: bool) -> tuple[int, str, bool]:
    """Send /generate while an update holds the model, end the update; (status, body, whether
    the reply came before the update ended)."""
    result: dict = {}
    with engine._model_lock:

        def call() -> None:
            r = http.post("/generate", json=BODY)
            result.update(status=r.status_code, text=r.text, t=time.monotonic())

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(1.0)
        ended = time.monotonic()
        engine.state.partial_weights = fails
    caller.join(timeout=60)
    return result["status"], result["text"], result["t"] < ended


def test_generate_waits_for_an_update_in_progress(tiny_model_dir) -> None:
    engine = HFEngine(str(tiny_model_dir), None, "float32", "cpu", 8, 1.0, "0", 30.0)
    engine.start()
    try:
        with TestClient(build_app(engine, 30.0)) as http:
            status, text, early = held_update(engine, http, fails=False)
            assert status == 200 and not early, text  # waited, then generated
            status, text, early = held_update(engine, http, fails=True)
            assert status == 503 and "midway" in text and not early, text
            r = http.post("/generate", json=BODY)  # refused at once until a complete update
            assert r.status_code == 503 and "midway" in r.text
    finally:
        engine.shutdown()
