"""Test helpers: a tiny Qwen3 model with a character tokenizer, and engine processes.

Imported by tests/unit/rollout/conftest.py and tests/integration/ (add tests/ to sys.path first).
Everything here runs on CPU in a few seconds and needs no model hub.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from relax_slurm.runtime.ports import free_port as plan_free_port

REPO_ROOT = Path(__file__).resolve().parents[1]

# <pad>=0, <eos>=1, <unk>=2, then one token per character: 16 tokens.
TINY_VOCAB = ["<pad>", "<eos>", "<unk>", *"0123456789", "+", "=", " "]


def make_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A random tiny Qwen3ForCausalLM (tied embeddings) and a char tokenizer, save_pretrained."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every character is its own token; decoding concatenates them back
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                     unk_token="<unk>")
    hf_tok.save_pretrained(out)

    config = Qwen3Config(
        vocab_size=len(TINY_VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"],
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    # random init is near uniform; widen it so greedy outputs depend visibly on the weights
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out


def free_port() -> int:
    """A TCP port free now, outside the range outgoing connections take (runtime.plan's)."""
    return plan_free_port()


def process_cpu_s(pid: int) -> float:
    """utime + stime of one live process, from /proc/PID/stat (the tests that assert a child
    was forked, not spawned, read its CPU time; tools/bench/load.py's parse_pid_stat also adds
    reaped children's, the same for these processes, which reap none)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    """The process runs and is not a zombie (a zombie is dead for the tests: its parent is gone
    or reaping it). /proc's state field, after the command name's closing parenthesis (the
    name may hold spaces)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def child_env() -> dict[str, str]:
    """Environment for child processes: one thread, the repo importable."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    paths = [str(REPO_ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def start_engine(model_dir: str | Path, port: int, log_path: str | Path,
                 extra_args: Optional[list[str]] = None, api_key: Optional[str] = None
                 ) -> subprocess.Popen:
    """Start `python -m relax_slurm.engines.hf` in its own process group (with
    `api_key`, it wants that Bearer token on every route but the probes, like a run's engines)."""
    cmd = [sys.executable, "-m", "relax_slurm.engines.hf", "--model-path", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--torch-threads", "1", "--seed", "0", "--weight-version", "0", *(extra_args or [])]
    log = open(log_path, "wb")
    try:
        env = child_env()
        if api_key is not None:
            from relax_slurm.engines.sglang_api import API_KEY_ENV

            env[API_KEY_ENV] = api_key
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(REPO_ROOT), start_new_session=True)
    finally:
        log.close()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float,
                 log_path: str | Path = "") -> None:
    """Poll GET /health until 200; fail early (with the log tail) if the process dies."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine at {url} exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"engine at {url} not healthy after {timeout_s}s:\n{_tail(log_path)}")


def stop_process(proc: Optional[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Terminate exactly this process (and the session it leads), then kill if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def running_engine(model_dir: str | Path, log_dir: Path, extra_args: list[str] | None = None,
                   timeout_s: float = 150) -> Iterator[str]:
    """An hf engine process on a free port, healthy: its URL; stopped on exit."""
    port, log = free_port(), log_dir / "engine.log"
    proc = start_engine(model_dir, port, log, extra_args)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout_s=timeout_s, log_path=log)
        yield url
    finally:
        stop_process(proc)


def run_logged(cmd: list[str], log: Path, timeout_s: float) -> int:
    """Run `cmd` in its own session with its output in `log`; its exit code. Whatever it
    left in that session (ranks, a forked checkpoint writer) is killed afterwards."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                cwd=str(REPO_ROOT), start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        stop_process(proc)


def _tail(path: str | Path, n: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_tiny_model_tool(out: Path) -> Path:
    """tools/make_tiny_model.py's code run in this process (which imports torch anyway)."""
    from relax_slurm.tiny.model import main

    assert main(["--out", str(out)]) == 0
    return out


def script_args() -> tuple[Path, list, Path]:
    """For scripts run as `SCRIPT --model-dir D --out F`: D, D's weights as (name, tensor) in
    file order, and F."""
    import argparse

    from safetensors.torch import load_file

    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model_dir = Path(args.model_dir)
    return model_dir, list(load_file(str(model_dir / "model.safetensors")).items()), \
        Path(args.out)


def perturbed(named: list, seed: int) -> list:
    """Other weights of the same shapes: each tensor plus 0.5 x N(0, 1) noise drawn from `seed`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype)) for n, t in named]


@dataclass
class ScriptEngine:
    model_dir: Path
    named: list
    """The model's weights as (name, tensor), in file order."""
    url: str
    engine: subprocess.Popen
    client: object
    """An EngineClient of the engine (300 s timeout)."""
    out: dict
    """The script's findings, written to --out at the end."""
    out_path: Path


@contextlib.contextmanager
def script_engine() -> Iterator[ScriptEngine]:
    """For scripts run as `SCRIPT --model-dir D --out F` that drive one hf engine on D: the
    engine, healthy, and a client; at the end, whatever happened, the client is closed, the
    engine stopped and `out` written to F as JSON."""
    import json

    from relax_slurm.engines.client import EngineClient

    model_dir, named, out_path = script_args()
    port, log = free_port(), out_path.with_suffix(".engine.log")
    url = f"http://127.0.0.1:{port}"
    engine = start_engine(model_dir, port, log)
    client = EngineClient(url, timeout_s=300)
    found = ScriptEngine(model_dir, named, url, engine, client, {}, out_path)
    try:
        wait_healthy(url, engine, 180, log)
        yield found
    finally:
        client.close()
        stop_process(engine)
        out_path.write_text(json.dumps(found.out))


def run_script(name: str, tmp_path: Path, *extra: str, model_dir: Optional[Path] = None,
               env: Optional[dict[str, str]] = None) -> dict:
    """tests/integration/scripts/NAME --model-dir (a tiny model) --out F [EXTRA], as a process
    of its own (it forms torch.distributed groups); its JSON findings."""
    import json

    model_dir = model_dir or make_tiny_model(tmp_path / "model")
    out = tmp_path / "result.json"
    script = REPO_ROOT / "tests" / "integration" / "scripts" / name
    proc = subprocess.run([sys.executable, str(script), "--model-dir", str(model_dir),
                           "--out", str(out), *extra], cwd=REPO_ROOT,
                          env=child_env() | (env or {}),
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def check_frozen_sync(r: dict) -> None:
    """What scripts/frozen_engine_sync.py found holds: the sync failed within its bounds naming
    the frozen engine 1 and not engine 0, and both took the re-formed cohort's resend."""
    received, frozen = r["urls"]
    assert r["error"] is not None, r
    # the frozen engine is named as the one that does not answer; the other, if listed at
    # all, only as waiting on the broadcast (gloo may hold its receive behind the frozen peer)
    silent = r["error"].split("does not answer HTTP")[0]
    assert f"engine 1 ({frozen})" in silent, r
    assert received not in silent, r
    assert "version 2" in r["error"] and "weight_sync.timeout_s" in r["error"], r
    # bounded: the begin call answered before the freeze, so only the bucket's wait
    # (timeout_s) and the /model_info probe of the late engines (at most 5 s, HEALTH_PROBE_S)
    # remain; one more timeout_s of slack for a loaded machine
    assert r["failed_after_s"] < 2 * r["timeout_s"] + 5, r
    # let go, the engine takes the re-formed cohort's resend with the other
    assert r["versions_after_resend"] == ["3", "3"], r


def engine_script_args():
    """`--model-dir D --out F --url URL`: what `run_script` passes a script that drives the
    engine at URL."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--url", required=True)
    return p.parse_args()


def start_sglang_engine(python: str | Path, model_dir: str | Path, port: int,
                        log_path: str | Path, api_key: str,
                        extra_args: list[str] | None = None) -> subprocess.Popen:
    """The real SGLang server on CPU (the venv of relax-sglang-cpu), started with the argv a
    run's engine gets (sglang_api.server_argv, device=cpu), in its own process group."""
    from relax_slurm.engines.sglang_api import API_KEY_ENV, server_argv

    argv = server_argv(str(python), model_path=str(model_dir), host="127.0.0.1", port=port,
                       base_gpu_id=0, tp_size=1, ep_size=1, mem_fraction_static=0.8,
                       dtype="float32", seed=0, trust_remote_code=False, api_key=True,
                       enable_memory_saver=False, extra_args=list(extra_args or []),
                       device="cpu", nccl_port=free_port())
    env = child_env() | {API_KEY_ENV: api_key}
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(REPO_ROOT), start_new_session=True)


def spawned_ranks(target, world: int, *args, timeout_s: float = 100) -> list:
    """Run `target(rank, *args, queue)` in `world` spawned processes; what each put on the
    queue, sorted (each rank puts one tuple starting with its rank). Every process is joined,
    or killed if it hangs."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        return sorted(queue.get(timeout=timeout_s) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def make_tiny_omni(out: Path, kind: str = "omni3") -> Path:
    """The tiny Qwen3-Omni (or `kind="omni25"`: Qwen2.5-Omni) at `out/model` and the colour and
    tone tasks' data (`out/colors`, `out/tones`), made in this process by the project's own
    builders."""
    from relax_slurm.tiny.media_tasks import write_colors, write_tones
    from relax_slurm.tiny.multimodal import build_multimodal

    build_multimodal(kind, out / "model")
    write_colors(out / "colors")
    write_tones(out / "tones")
    return out


def convert_final(run_dir: Path, out: Path, steps: int) -> tuple[dict, dict]:
    """relax-convert of the run's last dist-checkpoint into `out` (one rank); (the trainer's HF
    export at `steps`, the converted tensors)."""
    from safetensors.torch import load_file

    conv = subprocess.run([sys.executable, "-m", "relax_slurm.checkpoint.cli", "--input",
                           str(run_dir), "--output", str(out), "--no-progress"],
                          cwd=str(REPO_ROOT), env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=600)
    assert conv.returncode == 0, conv.stdout[-3000:] + conv.stderr[-3000:]
    return (load_file(str(run_dir / "hf" / f"step_{steps}" / "model.safetensors")),
            load_file(str(out / "model.safetensors")))
