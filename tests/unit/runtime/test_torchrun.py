"""runtime.torchrun, the trainer role's agent: torchrun itself, which leaves at once when its
ranks finished, and fails like torchrun when one of them fails."""

import json
import os
import subprocess
import sys

import pytest

from relax_slurm.runtime.zygote import FORKED_ENV
from tests.conftest import REPO

# a rank without torch: torchrun's environment on file, then the exit code asked for
RANK = """
import os, sys
rank = os.environ["RANK"]
open(os.path.join(sys.argv[1], "rank" + rank), "w").write(os.environ["WORLD_SIZE"])
sys.exit(int(sys.argv[2]) if rank == "1" else 0)
"""


def agent(module: str, tmp_path, rank_exit: int) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return subprocess.run([sys.executable, "-m", module, "--standalone", "--nproc-per-node=2",
                           "--monitor-interval=0.1", str(script), str(tmp_path), str(rank_exit)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_ranks_that_finish_end_the_agent_with_0(tmp_path):
    r = agent("relax_slurm.runtime.torchrun", tmp_path, rank_exit=0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [(tmp_path / f"rank{k}").read_text() for k in (0, 1)] == ["2", "2"]


@pytest.mark.timeout(300)
def test_a_failed_rank_fails_the_agent_as_torchrun_does(tmp_path):
    for d in ("ours", "theirs"):
        (tmp_path / d).mkdir()
    ours = agent("relax_slurm.runtime.torchrun", tmp_path / "ours", 3)
    theirs = agent("torch.distributed.run", tmp_path / "theirs", 3)
    assert theirs.returncode == 1  # torchrun reports a failed rank as its generic 1
    assert ours.returncode == theirs.returncode, ours.stderr[-3000:]
    for r in (ours, theirs):  # torchrun's own report, naming the rank and its exit code
        assert "ChildFailedError" in r.stderr and "exitcode  : 3" in r.stderr, r.stderr[-3000:]


# a rank run as a module (`-m forkrank`), as the trainer's are: where it runs, and whether torch
# was in it before it imported anything
FORK_RANK = """
import json, os, sys, time
preloaded = "torch" in sys.modules
out = {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "torch": preloaded,
       "world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:]}
rank = os.environ["RANK"]
path = os.path.join(sys.argv[1], "rank" + rank)
open(path + ".tmp", "w").write(json.dumps(out))
os.replace(path + ".tmp", path)  # whole, for rank 1 to read
if rank == "1":  # the agent's children once both ranks run (within 30 s): its ranks alone
    rank0 = os.path.join(sys.argv[1], "rank0")
    while not os.path.exists(rank0):
        time.sleep(0.01)
    ranks, deadline = {str(json.load(open(rank0))["pid"]), str(os.getpid())}, time.time() + 30
    while True:
        children = open(f"/proc/{os.getppid()}/task/{os.getppid()}/children").read().split()
        if set(children) <= ranks or time.time() > deadline:
            break
        time.sleep(0.01)
    open(os.path.join(sys.argv[1], "children"), "w").write(json.dumps(children))
sys.exit(int(sys.argv[2]) if rank == "1" else 0)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("forked", [True, False])
def test_an_agent_the_zygote_forked_forks_its_ranks_too(tmp_path, forked):
    """A local run's agent is forked by the launcher's zygote (runtime/zygote.py), with torch
    imported: its ranks are then forked from a zygote of its own instead of importing torch
    again, and are its children in sessions of their own as torchrun's Popen makes them, whose
    exit codes it reports as torchrun does. Not forked (a Slurm run's, a GPU machine's), it
    starts them as torchrun does."""
    (tmp_path / "forkrank.py").write_text(FORK_RANK)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    env.pop(FORKED_ENV, None)
    if forked:
        env[FORKED_ENV] = "1"
    agent = subprocess.Popen(
        [sys.executable, "-m", "relax_slurm.runtime.torchrun", "--standalone",
         "--nproc-per-node=2", "--monitor-interval=0.1", "-m", "forkrank", str(tmp_path), "3"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = agent.communicate(timeout=120)
    assert agent.returncode == 1, err[-3000:]  # rank 1's 3, reported as torchrun's generic 1
    assert "ChildFailedError" in err and "exitcode  : 3" in err, err[-3000:]
    for k in (0, 1):
        rank = json.loads((tmp_path / f"rank{k}").read_text())
        assert rank["world"] == "2" and rank["argv"] == [str(tmp_path), "3"]
        assert rank["ppid"] == agent.pid and rank["sid"] == rank["pid"]
        assert rank["torch"] == forked
    # no zygote left among them (rank 0 may be gone already)
    children = json.loads((tmp_path / "children").read_text())
    assert set(children) <= {str(json.loads((tmp_path / f"rank{k}").read_text())["pid"])
                             for k in (0, 1)}


# megatron's state in a trainer rank, as one fresh process reaches it (ZYGOTE=0) or as the
# agent's zygote leaves it for a forked rank (ZYGOTE=1): the rank then runs its own imports
MEGATRON_STATE = """
import json, os, sys
from pathlib import Path
if os.environ["ZYGOTE"] == "1":
    from relax_slurm.runtime.torchrun import trainer_imports
    from relax_slurm.runtime.zygote import _preload
    imports = trainer_imports(["--run-dir", sys.argv[1]])
    _preload(imports)
else:
    imports = []
import relax_slurm.trainer.megatron.backend  # what a megatron rank then does itself
from relax_slurm.trainer.megatron import bridges, cpu_compat
cpu_compat.import_bridge()
bridges.register()
import megatron.core.jit as jit
mods = {n: m for n, m in list(sys.modules.items()) if n.startswith("megatron.")}
print(json.dumps({
    "imports": imports,
    "have_te": {n: m.HAVE_TE for n, m in mods.items()
                if isinstance(getattr(m, "HAVE_TE", None), bool)},
    "megatron": sorted(mods),
    "te": repr(sys.modules.get("transformer_engine")),
    "jit_fuser": jit.jit_fuser.__name__,
}))
"""


@pytest.mark.timeout(300)
def test_a_megatron_rank_forked_from_the_zygote_has_the_state_a_fresh_rank_has(tmp_path):
    """Under trainer.backend=megatron the agent's zygote imports megatron-core and
    megatron-bridge for the ranks (~5.5 CPU-s each), through cpu_compat as a rank does: a rank
    forked from it sees the modules, the HAVE_TE flags (False: megatron.core's local layers
    with transformer-engine stubbed after it; a few that megatron-bridge imports later see
    the stub) and the jit fuser a fresh rank sees."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "config.yaml").write_text(
        f"trainer: {{backend: megatron}}\nmodel: {{path: {model}}}\n")
    (tmp_path / "state.py").write_text(MEGATRON_STATE)
    states = []
    for zygote in ("0", "1"):
        r = subprocess.run([sys.executable, str(tmp_path / "state.py"), str(tmp_path)],
                           cwd=REPO, env=dict(os.environ, ZYGOTE=zygote, PYTHONPATH=str(REPO)),
                           capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        states.append(json.loads(r.stdout.strip().splitlines()[-1]))
    fresh, forked = states
    assert "relax_slurm.trainer.megatron.bridges:register" in forked["imports"]
    assert "transformers.models.qwen3.modeling_qwen3" in forked["imports"]
    # the GPT layers megatron-bridge builds are megatron.core's local ones on CPU
    assert fresh["have_te"]["megatron.core.models.gpt.gpt_layer_specs"] is False
    for key in ("have_te", "megatron", "te", "jit_fuser"):
        assert forked[key] == fresh[key], key
