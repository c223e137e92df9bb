"""The client's protocol against SGLang's own code, for every release of the pinned range
(`sglang_api.TESTED_SGLANG`), on CPU: each release's wheel is downloaded without its
dependencies (once; kept in RELAX_SGLANG_SRC, default ~/.cache/relax_slurm/sglang), its Python
sources are read (request types, routes, answers: `ast`, nothing imported), and its own
argument parser parses every launch line the launcher writes (a subprocess importing its
server_args, triton stubbed)."""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from relax_slurm.engines import sglang_api as api

pytestmark = pytest.mark.timeout(600)
SRC_CACHE = Path(os.environ.get("RELAX_SGLANG_SRC",
                                Path.home() / ".cache" / "relax_slurm" / "sglang"))
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def sglang_source(version: str) -> Path:
    """SGLang `version`'s Python sources (the wheel's .py files), fetched once."""
    dest = SRC_CACHE / version
    if (dest / ".complete").exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", f"sglang=={version}", "--dest", tmp],
                       check=True, timeout=900)
        [wheel] = Path(tmp).glob("sglang-*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(dest, [n for n in z.namelist() if n.endswith(".py")])
    (dest / ".complete").write_text(version)
    return dest


@pytest.fixture(scope="module", params=api.TESTED_SGLANG)
def src(request) -> Path:
    return sglang_source(request.param) / "sglang" / "srt"


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def class_fields(tree: ast.Module, name: str) -> dict[str, bool]:
    """{field: has a default} of class `name` (dataclass or msgspec Struct), with the fields of
    its bases defined in the same module, and the arguments of its __init__ if it has one."""
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}

    def fields(cls: ast.ClassDef) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out |= fields(classes[base.id])
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out[stmt.target.id] = stmt.value is not None
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                args = stmt.args.args[1:] + stmt.args.kwonlyargs
                defaults = [None] * (len(stmt.args.args) - 1 - len(stmt.args.defaults)) \
                    + stmt.args.defaults + stmt.args.kw_defaults
                out |= {a.arg: d is not None for a, d in zip(args, defaults)}
        return out

    assert name in classes, f"{name} is not defined"
    return fields(classes[name])


def routes(tree: ast.Module) -> dict[str, set[str]]:
    """{path: HTTP methods} of the FastAPI app's decorated handlers."""
    out: dict[str, set[str]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"
                    and dec.args and isinstance(dec.args[0], ast.Constant)):
                continue
            verb = dec.func.attr
            methods = {verb.upper()} if verb != "api_route" else {
                m.value for k in dec.keywords if k.arg == "methods" for m in k.value.elts}
            out.setdefault(dec.args[0].value, set()).update(methods)
    return out


def test_every_request_field_we_send_is_a_field_of_sglangs_request(src):
    io = parse(src / "managers" / "io_struct.py")
    for name, (required, optional) in api.SGLANG_REQUESTS.items():
        fields = class_fields(io, name)
        for key in required | optional:
            assert key in fields, (name, key)
        for key in required:  # required here: no default there
            assert not fields[key], (name, key, "has a default in SGLang")
        for key in optional:  # ours to leave out: SGLang has a default
            assert fields[key], (name, key, "is required in SGLang")
    sampling = class_fields(parse(src / "sampling" / "sampling_params.py"), "SamplingParams")
    sent = {"max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed"}
    assert sent <= set(sampling), sent - set(sampling)


def test_every_route_we_call_exists_and_the_removed_ones_do_not(src):
    served = routes(parse(src / "entrypoints" / "http_server.py"))
    for route in api.POST_ROUTES:
        assert "POST" in served.get(route, set()), route
    for route in (*api.GET_ROUTES, *api.DEPRECATED_ROUTE.values()):
        assert "GET" in served.get(route, set()), route
    assert "/get_weight_version" not in served  # removed in 0.5.21: /model_info carries it


def entry_classes(models: Path) -> set[str]:
    """The architectures SGLang serves: every name its model files' `EntryClass` gives."""
    names = set()
    for f in models.glob("*.py"):
        for node in ast.walk(parse(f)):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
                value = node.value
                items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
                names |= {x.id for x in items if isinstance(x, ast.Name)}
    return names


def test_the_architectures_refused_on_sglang_have_no_model_there(src):
    """sglang_api.NO_SGLANG_MODEL (refused at start with rollout=sglang) has no model class in
    the release; the multimodal architectures the project serves on SGLang do."""
    served = entry_classes(src / "models")
    assert {"Qwen3OmniMoeForConditionalGeneration", "Qwen2AudioForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
            "Qwen3ForCausalLM"} <= served
    assert not served & set(api.NO_SGLANG_MODEL), served & set(api.NO_SGLANG_MODEL)


def test_the_hf_engine_serves_the_same_routes(src):
    from relax_slurm.engines.hf.server import build_app

    class Engine:  # build_app only registers routes; nothing is called
        pass

    ours: dict[str, set[str]] = {}
    for r in build_app(Engine(), 1.0).routes:
        ours.setdefault(r.path, set()).update(getattr(r, "methods", set()))
    served = routes(parse(src / "entrypoints" / "http_server.py"))
    for route in (*api.POST_ROUTES, *api.GET_ROUTES, *api.DEPRECATED_ROUTE.values()):
        assert served[route] & ours.get(route, set()), route


def test_answers_the_client_and_the_hf_engine_rely_on(src):
    from relax_slurm.engines.hf.core import ABORTED, ABORTED_WAITING
    from relax_slurm.weightsync import sender

    # every string literal of the managers (implicit concatenations joined, as Python does)
    strings = {n.value for p in (src / "managers").rglob("*.py") for n in ast.walk(parse(p))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    http = (src / "entrypoints" / "http_server.py").read_text()
    assert '"version": __version__' in http  # /server_info's version
    assert api.OUT_OF_SESSION in strings
    assert any(sender.STALE_SESSION in s and "session" in s for s in strings)
    # in_place cannot flush: 0.5.21 asserts (the scheduler dies), 0.5.22+ answer this
    assert api.FLUSH_REFUSED in strings or "Cache flush failed after updating weights" in strings
    # aborted requests' finish reasons, as the hf engine gives them
    finish = [n for n in ast.walk(parse(src / "managers" / "schedule_batch.py"))
              if isinstance(n, ast.ClassDef) and n.name == "FINISH_ABORT"][0]
    keys = {k.value for n in ast.walk(finish) if isinstance(n, ast.Dict) for k in n.keys}
    constants = {n.value for n in ast.walk(finish) if isinstance(n, ast.Constant)}
    assert keys == set(ABORTED) and ABORTED["message"] in constants
    assert ABORTED_WAITING["message"] in strings
    # meta_info.weight_versions: [{version, start, end}], weight_version the last span's
    [add] = [n for n in ast.walk(parse(src / "utils" / "weight_versions.py"))
             if isinstance(n, ast.FunctionDef) and n.name == "add_weight_versions_to_meta_info"]
    span_keys = [{k.value for k in n.keys} for n in ast.walk(add) if isinstance(n, ast.Dict)]
    assert span_keys == [{"version", "start", "end"}]
    set_keys = {t.slice.value for n in ast.walk(add) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Subscript)}
    assert set_keys == {"weight_versions", "weight_version"}
    # meta_info.routed_experts: base64 of numpy int32 ids (relax_slurm.routing.shape), when the
    # request asks and the server was started with the flag
    tm = parse(src / "managers" / "tokenizer_manager.py")
    assert any(isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant)
               and n.slice.value == "routed_experts" and isinstance(n.value, ast.Name)
               and n.value.id == "meta_info" for n in ast.walk(tm))
    capturer = (src / "state_capturer" / "routed_experts.py").read_text()
    assert "dtype=np.int32" in capturer and "enable_return_routed_experts" in capturer


def launch_lines() -> list[list[str]]:
    """The flags of every shape of launch line the launcher writes."""
    base = dict(model_path="/m", host="0.0.0.0", port=30000, base_gpu_id=4, tp_size=2,
                ep_size=1, mem_fraction_static=0.7, dtype="bfloat16", seed=3,
                trust_remote_code=False, api_key=False, enable_memory_saver=False,
                extra_args=[], nccl_port=12345)
    variants = [base, {**base, "ep_size": 2, "trust_remote_code": True},
                {**base, "enable_memory_saver": True, "deterministic": True,
                 "extra_args": ["--context-length", "8192"]},
                {**base, "api_key": True}, {**base, "routed_experts": True},
                {**base, "tp_size": 1, "device": "cpu"},
                # data.image_*_pixels (JSON with spaces and quotes, through bash -c's quoting)
                {**base, "api_key": True,
                 "extra_args": api.mm_process_args("/nowhere", 1024, 200704)}]
    lines = []
    for v in variants:
        argv = api.server_argv("/py", **v)
        if argv[:2] == ["bash", "-c"]:  # the key comes from the environment at start
            argv = shlex.split(argv[2].removeprefix("exec ").replace(
                f'"${api.API_KEY_ENV}"', "s3cret"))
        # every engine's environment, and for device=cpu SGLang's CPU engine
        env = api.RL_ENV | (api.SERVER_ENV if v.get("device") == "cpu" else {})
        assert argv[:1 + len(env)] == ["env", *(f"{k}={x}" for k, x in env.items())]
        argv = argv[1 + len(env):]
        assert argv[:3] == ["/py", "-m", "sglang.launch_server"]
        lines.append(argv[3:])
    return lines


def test_every_launch_line_parses_with_sglangs_own_parser(src):
    lines = launch_lines()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src.parent.parent), str(REPO)])}
    proc = subprocess.run([sys.executable, str(HERE / "sglang_parse_argv.py")],
                          input=json.dumps(lines), capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(REPO))
    missing = "ModuleNotFoundError" in proc.stderr
    assert proc.returncode == 0, (
        ("SGLang's server_args imports a module the README's commands do not install: add it "
         "to setup.cfg's dev extra\n" if missing else "") + proc.stderr[-4000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["version"] == src.parent.parent.name
    plain, ep, det, keyed, routed, cpu, media = out["parsed"]
    assert (plain["model_path"], plain["port"], plain["base_gpu_id"], plain["tp_size"]) == \
        ("/m", 30000, 4, 2)
    assert plain["mem_fraction_static"] == 0.7 and plain["dtype"] == "bfloat16"
    assert plain["random_seed"] == 3 and plain["weight_version"] == "0"
    assert plain["nccl_port"] == 12345  # the store port the launcher reserved for it
    assert not plain["enable_deterministic_inference"] and not plain["enable_memory_saver"]
    assert ep["ep_size"] == 2 and ep["trust_remote_code"]
    assert det["enable_deterministic_inference"] and det["enable_memory_saver"]
    assert det["context_length"] == 8192
    assert keyed["api_key"] == "s3cret"
    assert routed["enable_return_routed_experts"] and not plain["enable_return_routed_experts"]
    # the CPU engine (docs/engines.md#sglang-on-cpu): its device, attention, bounded KV pool
    assert (cpu["device"], cpu["attention_backend"], cpu["max_total_tokens"]) == \
        ("cpu", "torch_native", 16384)
    assert cpu["disable_cuda_graph"] and cpu["skip_server_warmup"] and cpu["sleep_on_idle"]
    assert cpu["tp_size"] == 1 and plain["device"] != "cpu" and not plain["sleep_on_idle"]
    assert media["mm_process_config"] == {
        "image": {"size": {"shortest_edge": 1024, "longest_edge": 200704}}}
    assert media["api_key"] == "s3cret" and plain["mm_process_config"] in (None, {})
