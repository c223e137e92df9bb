"""`relax-sglang-cpu install | path`: build (or find) the CPU SGLang venv.

    relax-sglang-cpu install   # builds ~/.cache/relax_slurm/sglang-cpu-0.5.23/venv (minutes, once)
    relax-sglang-cpu path      # prints its python (exit 1 if not built or out of date)
"""

from __future__ import annotations

import argparse
import sys

from relax_slurm.engines import sglang_cpu
from relax_slurm.errors import RelaxError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relax-sglang-cpu",
        description=f"The real SGLang {sglang_cpu.SGLANG_VERSION} for machines without GPUs, in "
                    "a venv of its own (rollout=sglang uses it; docs/engines.md#sglang-on-cpu).")
    parser.add_argument("command", choices=("install", "path"))
    args = parser.parse_args(argv)
    if args.command == "path":
        if not sglang_cpu.is_current():
            print(f"relax-sglang-cpu: {sglang_cpu.venv_dir()} is not built or out of date: run "
                  "relax-sglang-cpu install", file=sys.stderr)
            return 1
        print(sglang_cpu.venv_python())
        return 0
    try:
        print(sglang_cpu.ensure_venv(say=lambda line: print(line, flush=True)))
    except RelaxError as e:
        print(f"relax-sglang-cpu: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
