"""Write the "a+b=" -> a+b prompt sets of the embedded CPU default.

    python tools/prepare_data.py --out tiny

The command line of `relax_slurm.tiny.arith` (see its docstring); `relax-train experiment=tiny_*` also builds
what it needs on first use (relax_slurm/tiny/assets.py).
"""

import sys

from relax_slurm.tiny.arith import main

if __name__ == "__main__":
    sys.exit(main())
