"""The bodies our client sends match the recorded SGLang requests (sglang_api), the versions and
pause modes it accepts; the record itself is checked against every pinned release's source in
test_sglang_source.py. With sglang installed (GPU clusters) a real server answers the client
(marked gpu)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from relax_slurm.errors import EngineError
from relax_slurm.engines import sglang_api as api

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
BODIES = {
    "/init_weights_update_group": api.init_group_body("10.0.0.1", 29500, 1, 3, "g", "nccl"),
    "/update_weights_from_distributed": api.update_weights_body(
        ["w"], ["bfloat16"], [(2, 3)], "g", "7", True),
    "/update_weights_from_distributed (flattened)": api.update_weights_body(
        ["w"], ["bfloat16"], [(2, 3)], "g", "7", True, load_format="flattened_bucket"),
    "/pause_generation": api.pause_body("retract"),
    "/begin_weight_update": {},
    "/end_weight_update": {},
    "/continue_generation": {},
    "/abort_request": api.abort_body(abort_all=True),
    "/release_memory_occupation": api.memory_body(None),
    "/resume_memory_occupation": api.memory_body(["weights"]),
}


def test_generate_bodies_with_media_build_sglang_requests():
    from relax_slurm.engines.client import ClientBase

    body = ClientBase._generate_body([[1, 2], [3]], {"max_new_tokens": 4}, True, 0,
                                media=[{"image": ["/a.png"], "audio": ["UklGRg=="]}, {}])
    api.check_body("/generate", body)
    assert body["image_data"] == [["/a.png"], []] and body["audio_data"] == [["UklGRg=="], []]
    assert "image_data" not in ClientBase._generate_body([[1]], {}, True)


@pytest.mark.parametrize("route", BODIES)
def test_client_bodies_build_sglang_requests(route):
    api.check_body(route.split(" ")[0], BODIES[route])


def test_load_format_is_sent_only_when_set():
    # older servers may not know the field: one broadcast per tensor does not name it
    assert "load_format" not in BODIES["/update_weights_from_distributed"]
    assert BODIES["/update_weights_from_distributed (flattened)"]["load_format"] == \
        "flattened_bucket"


def test_server_versions_outside_the_range_are_refused_naming_it():
    assert api.server_protocol({"version": "0.5.22"}, "u") == api.ServerProtocol("sglang", "0.5.22")
    assert api.server_protocol({"engine": "hf", "version": "0.5.23"}, "u").engine == "hf"
    for version in ("0.5.20", "0.5.24", "0.4.10", "", "nonsense"):
        with pytest.raises(EngineError, match=r"speaks SGLang >=0\.5\.21,<0\.5\.24") as e:
            api.server_protocol({"version": version} if version else {}, "http://h:1")
        assert "http://h:1" in str(e.value) and "pip install" in str(e.value)


def test_pause_modes_that_cannot_flush_are_refused_with_the_reason():
    proto = api.ServerProtocol("sglang", "0.5.22")
    for mode in ("retract", "abort"):
        proto.check_pause_mode(mode)
    with pytest.raises(EngineError, match="weight_sync.pause_mode=in_place: SGLang 0.5.22 cannot "
                                          "flush"):
        proto.check_pause_mode("in_place")
    with pytest.raises(ValueError, match="pause mode 'nap'"):
        api.pause_body("nap")


def test_the_gpu_extra_pins_the_supported_range():
    import configparser

    from helpers_tiny import REPO_ROOT

    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    gpu = [line.strip() for line in cfg["options.extras_require"]["gpu"].splitlines()]
    assert f"sglang{api.SUPPORTED_SGLANG}" in gpu


def test_issue_fields_are_recorded():
    """The fields the issue lists for SGLang 0.5.x, checked against our record."""
    req, opt = api.SGLANG_REQUESTS["InitWeightsUpdateGroupReqInput"]
    assert req | opt == {"master_address", "master_port", "rank_offset", "world_size",
                         "group_name", "backend"}
    req, opt = api.SGLANG_REQUESTS["UpdateWeightsFromDistributedReqInput"]
    assert {"names", "dtypes", "shapes"} == req
    assert {"group_name", "flush_cache", "abort_all_requests", "weight_version",
            "load_format"} <= opt
    body = BODIES["/update_weights_from_distributed"]
    assert body["shapes"] == [[2, 3]] and body["weight_version"] == "7"


def test_unknown_or_missing_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown \['mode_x'\]"):
        api.check_body("/pause_generation", {"mode_x": "abort"})
    with pytest.raises(ValueError, match=r"missing \['world_size'\]"):
        body = dict(BODIES["/init_weights_update_group"])
        del body["world_size"]
        api.check_body("/init_weights_update_group", body)


def test_server_argv_has_sglang_flags():
    argv = api.server_argv("/py", model_path="/m", host="0.0.0.0", port=30000, base_gpu_id=4,
                           tp_size=2, ep_size=2, mem_fraction_static=0.7, dtype="bfloat16",
                           seed=3, trust_remote_code=True, api_key=False, enable_memory_saver=True,
                           extra_args=["--context-length", "8192"])
    # no image features cached across weight syncs (api.RL_ENV)
    assert argv[:5] == ["env", "SGLANG_VLM_CACHE_SIZE_MB=0", "/py", "-m", "sglang.launch_server"]
    flags = dict(zip(argv[5::2], argv[6::2]))
    for flag, value in {"--model-path": "/m", "--port": "30000", "--base-gpu-id": "4",
                        "--tp-size": "2", "--mem-fraction-static": "0.7"}.items():
        assert flag in argv and argv[argv.index(flag) + 1] == value, (flag, flags)
    assert argv[argv.index("--ep-size") + 1] == "2" and "--enable-memory-saver" in argv
    assert argv[-2:] == ["--context-length", "8192"] and "--api-key" not in argv
    assert "--trust-remote-code" in argv
    keyed = api.server_argv("/py", model_path="/m", host="h", port=1, base_gpu_id=0, tp_size=1,
                            ep_size=1, mem_fraction_static=0.8, dtype="float16", seed=0,
                            trust_remote_code=False, api_key=True, enable_memory_saver=False, extra_args=[])
    assert keyed[:2] == ["bash", "-c"] and keyed[2].startswith(
        "exec env SGLANG_VLM_CACHE_SIZE_MB=0 /py -m sglang.launch_server")
    assert keyed[2].endswith(f'--api-key "${api.API_KEY_ENV}"') and "--ep-size" not in keyed[2]


def test_image_limits_reach_sglang_as_its_mm_process_config(tmp_path):
    """data.image_*_pixels -> --mm-process-config: SGLang's image processor must resize as the
    worker's does. The model directory's other limit is kept (both keys are needed); a limit
    the user passes in rollout.engine_extra_args wins; no limits, no flag."""
    import json

    from relax_slurm.config import TrainConfig
    from relax_slurm.config.data import DataConfig
    from relax_slurm.config.model import ModelConfig
    from relax_slurm.config.rollout import RolloutConfig
    from relax_slurm.launch.roles import sglang_media_args

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 784, "longest_edge": 3136}, "patch_size": 14}))
    flag, value = api.mm_process_args(str(tmp_path), None, 1568)
    assert flag == "--mm-process-config"
    assert json.loads(value) == {"image": {"size": {"shortest_edge": 784, "longest_edge": 1568}}}
    # an older processor's spelling (min_pixels / max_pixels)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 100,
                                                                   "max_pixels": 900}))
    _, value = api.mm_process_args(str(tmp_path), 400, None)
    assert json.loads(value)["image"]["size"] == {"shortest_edge": 400, "longest_edge": 900}
    assert api.mm_process_args(str(tmp_path / "nowhere"), 400, 800)[1] == json.dumps(
        {"image": {"size": {"longest_edge": 800, "shortest_edge": 400}}}, sort_keys=True)
    # one limit, the model's config not readable here (a hub id not in the local cache): no
    # flag, since the processor refuses a size with one key
    assert api.mm_process_args("Qwen/not-cached-here", None, 800) == []
    assert api.mm_process_args(str(tmp_path), None, None) == []
    mine = ["--mm-process-config", '{"image": {}}']
    assert api.mm_process_args(str(tmp_path), 400, 800, mine) == []

    def cfg(keys, **data) -> TrainConfig:
        return TrainConfig(run_dir="x", model=ModelConfig(path=str(tmp_path)),
                           data=DataConfig(train_files=["x"], multimodal_keys=keys, **data),
                           rollout=RolloutConfig(engine="sglang"))
    assert sglang_media_args(cfg({"image": "images"}, image_max_pixels=900), str(tmp_path))
    assert sglang_media_args(cfg({}, image_max_pixels=900), str(tmp_path)) == []  # text data


def test_clients_send_the_api_key_from_the_environment(monkeypatch):
    from relax_slurm.engines.client import EngineClient

    monkeypatch.setenv(api.API_KEY_ENV, "s3cret")
    with EngineClient("http://127.0.0.1:1") as c:
        assert c._http.headers["Authorization"] == "Bearer s3cret"
    monkeypatch.delenv(api.API_KEY_ENV)
    with EngineClient("http://127.0.0.1:1") as c:
        assert "Authorization" not in c._http.headers


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SGLANG or not os.environ.get("RELAX_SGLANG_TEST_MODEL"),
                    reason="needs sglang, a GPU and RELAX_SGLANG_TEST_MODEL=<small HF model dir>")
def test_real_sglang_server_answers_the_client(tmp_path):
    import subprocess
    import sys

    from relax_slurm.runtime.ports import free_port
    from relax_slurm.engines.client import EngineClient, wait_until_healthy

    port = free_port()
    argv = api.server_argv(sys.executable, model_path=os.environ["RELAX_SGLANG_TEST_MODEL"],
                           host="127.0.0.1", port=port, base_gpu_id=0, tp_size=1, ep_size=1,
                           mem_fraction_static=0.5, dtype="bfloat16", seed=0,
                           trust_remote_code=False, api_key=False,
                           enable_memory_saver=True, extra_args=[])
    log = open(tmp_path / "sglang.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy([url], timeout_s=600)
        with EngineClient(url) as c:
            assert c.health_generate()
            out = c.generate([[1, 2, 3]], {"max_new_tokens": 4, "temperature": 1.0})
            assert 1 <= len(out[0].output_ids) <= 4 and len(out[0].logprobs) == len(out[0].output_ids)
            assert c.weight_version() == "0"
            assert c.protocol().engine == "sglang"  # a release in the pinned range
            assert out[0].weight_versions[0][0] == "0"
            c.pause_generation("retract")  # SGLang asserts an idle engine before a release
            c.release_memory_occupation()
            c.resume_memory_occupation()
            c.begin_weight_update()
            c.end_weight_update()
            c.abort_request(abort_all=True)
            c.continue_generation()
            c.flush_cache()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
