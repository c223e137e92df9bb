"""`python -m relax_slurm.runtime.torchrun ARGS`: torchrun (`torch.distributed.run ARGS`) that
leaves without the interpreter's teardown once its ranks have all finished.

The trainer role's agent imports torch to start and watch its ranks; after they finished, its
interpreter spent ~0.5 CPU-s finalizing modules (measured: 2.05 -> 1.42 CPU-s for an agent of
one rank), 1-3 s of wall time on a busy 2-core machine, before the launcher could see the run
end; every run paid it. torchrun's own work is done by then (its rendezvous closed, its ranks
reaped), so this leaves as the roles do (runtime/exit.py). Anything else is torchrun's own
path: a failed rank raises ChildFailedError (exit code 1, its report), a signal
SignalException, both with the usual teardown.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.run import main as torchrun

from relax_slurm.runtime.exit import exit_now
from relax_slurm.runtime.lifetime import adopt_orphans
from relax_slurm.runtime.stacks import RUN_DIR_ENV, register_stack_dumps
from relax_slurm.runtime.zygote import FORKED_ENV, Zygote, model_code


def trainer_imports(args: list[str]) -> list[str]:
    """What a trainer rank (`-m relax_slurm.trainer ARGS`) imports before its first step: our
    trainer's modules, transformers and the model's code (model.path, read from
    RUN_DIR/config.yaml). Under trainer.backend=megatron first megatron-core and
    megatron-bridge (~5.5 CPU-s a rank), the way each rank imports them: through
    cpu_compat.import_bridge, which stubs transformer-engine only once megatron.core is in
    (so it still builds its local layers), and the project's bridges registered
    (trainer/megatron/bridges.py); transformers comes in with megatron-bridge, as in a rank."""
    imports = ["relax_slurm.trainer.main", "relax_slurm.trainer.model"]
    try:
        run_dir = Path(args[args.index("--run-dir") + 1])
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        if cfg["trainer"]["backend"] == "megatron":
            imports += ["relax_slurm.trainer.megatron.backend",
                        "relax_slurm.trainer.megatron.bridges:register"]
        return [*imports, "transformers", *model_code(str(cfg["model"]["path"]))]
    except (OSError, ValueError, KeyError, TypeError, IndexError, yaml.YAMLError):
        return imports


def rank_imports(argv: list[str]) -> dict[str, list[str]]:
    """The module torchrun's `argv` runs in each rank (`-m MODULE ARGS`) and what to import
    for it beyond torch, which the agent has; {} for a script (it starts as torchrun starts
    it)."""
    flag = next((i for i, a in enumerate(argv) if a in ("-m", "--module")), None)
    if flag is None or flag + 1 >= len(argv):
        return {}
    module, args = argv[flag + 1], argv[flag + 2:]
    return {module: trainer_imports(args) if module == "relax_slurm.trainer" else []}


def fork_ranks(imports: dict[str, list[str]]) -> bool:
    """When this agent was itself forked by a local run's zygote (runtime/zygote.py; no GPU
    on the machine), fork its ranks too: from a zygote of its own, forked from this process
    (torch imported already) before torchrun starts a thread, which imports the trainer's
    modules once for every rank. torchrun starts each rank through
    `SubprocessHandler._popen`; this one asks the zygote first and falls back to torchrun's
    own for anything the zygote does not fork (output redirected by torchrun's --redirects,
    a NUMA-bound command). The ranks become this process's children (it adopts them, as the
    launcher adopts its roles), so torchrun waits for and signals them as its own. Once they
    are all started the zygote goes."""
    popen = getattr(subprocess_handler.SubprocessHandler, "_popen", None)
    start = getattr(SubprocessContext, "_start", None)
    if not (os.environ.get(FORKED_ENV) and imports and popen and start) or not adopt_orphans():
        return False
    zygote = Zygote.fork_here(imports, f"{sys.executable} -m relax_slurm.runtime.zygote "
                                       "(forks this run's trainer ranks)")

    def forked_popen(handler, args, env):
        if handler._stdout is None and handler._stderr is None:
            forked = zygote.fork([str(a) for a in args], env, None, None)
            if forked is not None:
                return forked
        return popen(handler, args, env)

    def start_then_close(context):
        start(context)  # every rank, each through `forked_popen`
        # no rank is left to fork (torchrun restarting its workers starts them as it always
        # does): the agent's children are its ranks alone again, as `pgrep -P` expects
        zygote.close()

    subprocess_handler.SubprocessHandler._popen = forked_popen
    SubprocessContext._start = start_then_close
    return True


def main() -> None:
    fork_ranks(rank_imports(sys.argv[1:]))
    # the agent's own stacks on SIGUSR2 (it does not relay it: its ranks register their own)
    register_stack_dumps(os.environ.get(RUN_DIR_ENV), "trainer-agent")
    torchrun()  # reads sys.argv as `python -m torch.distributed.run` does
    exit_now(0)


if __name__ == "__main__":
    main()
