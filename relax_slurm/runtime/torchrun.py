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

from torch.distributed.run import main as torchrun

from relax_slurm.runtime.exit import exit_now
from relax_slurm.runtime.stacks import RUN_DIR_ENV, register_stack_dumps


def main() -> None:
    # the agent's own stacks on SIGUSR2 (it does not relay it: its ranks register their own)
    register_stack_dumps(os.environ.get(RUN_DIR_ENV), "trainer-agent")
    torchrun()  # reads sys.argv as `python -m torch.distributed.run` does
    exit_now(0)


if __name__ == "__main__":
    main()
