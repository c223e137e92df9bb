"""Write the prompt sets of the tiny CPU presets.

    python tools/prepare_data.py --out tiny                   # "a+b=" (experiment=tiny_cpu)
    python tools/prepare_data.py --task longtail --out tiny   # "d*n=" (experiment=tiny_longtail_cpu)

The command lines of `relax_slurm.tiny.arith` and `relax_slurm.tiny.longtail` (see their
docstrings; the other options are theirs); `relax-train experiment=tiny_*` also builds what
it needs on first use (relax_slurm/tiny/assets.py).
"""

import sys

TASKS = {"arith": "relax_slurm.tiny.arith", "longtail": "relax_slurm.tiny.longtail"}


def main(argv: list[str]) -> int:
    task = "arith"
    if "--task" in argv:
        i = argv.index("--task")
        if i + 1 >= len(argv) or argv[i + 1] not in TASKS:
            print(f"--task: choose from {', '.join(TASKS)}", file=sys.stderr)
            return 2
        task, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    import importlib
    return importlib.import_module(TASKS[task]).main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
