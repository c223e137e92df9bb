"""Leave a role's process without tearing the interpreter down.

A process that imported torch and transformers spends seconds at exit finalizing modules and
freeing objects: a tiny run's trainer ranks took ~9 s to go after the last checkpoint was
committed, which every run (and every test) paid. Roles call `exit_now` once everything they
own is closed (checkpoint written, sockets and files closed); what is left is memory the OS
frees anyway. Only on the normal path: an exception still unwinds and prints as usual.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    # multiprocessing's own exit hook is skipped too; run its finalizers, or helper processes
    # outlive the role as orphans (megatron-core's checkpoint writer starts a Manager process
    # in every trainer rank: each run left two processes behind)
    multiprocessing.util._run_finalizers(0)
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing more to say
            pass
    os._exit(code)
