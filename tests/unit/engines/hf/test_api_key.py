"""The hf engine's API key (as SGLang's --api-key): every route but the probes (/health*,
/ready*, /metrics*) wants `Authorization: Bearer KEY`; the engine clients send it from
RELAX_ENGINE_API_KEY."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from relax_slurm.engines import sglang_api
from relax_slurm.engines.hf.core import HFEngine
from relax_slurm.engines.hf.server import build_app

pytestmark = pytest.mark.timeout(120)


def test_routes_need_the_key_except_health(tiny_model_dir, monkeypatch) -> None:
    engine = HFEngine(str(tiny_model_dir), None, "float32", "cpu", 8, 1.0, "0", 30.0)
    engine.start()
    try:
        with TestClient(build_app(engine, 30.0, api_key="k3y")) as http:
            assert http.get("/health").status_code == 200
            assert http.get("/ready").status_code == 200  # a cluster's readiness probe too
            for route in ("/model_info", "/server_info"):
                assert http.get(route).status_code == 401
                assert http.get(route, headers={"Authorization": "Bearer nope"}).status_code == 401
            r = http.post("/generate", json={"input_ids": [4, 5], "sampling_params": {}})
            assert r.status_code == 401 and "API key" in r.json()["error"]
            monkeypatch.setenv(sglang_api.API_KEY_ENV, "k3y")
            assert http.get("/model_info", headers=sglang_api.auth_headers()).status_code == 200
        with TestClient(build_app(engine, 30.0)) as http:  # no key: open, as before
            assert http.get("/model_info").status_code == 200
    finally:
        engine.shutdown()
