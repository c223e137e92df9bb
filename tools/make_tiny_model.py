"""Build the tiny Qwen3 model (or a multimodal sibling) and tokenizer of the CPU presets.

    python tools/make_tiny_model.py --out tiny/model \
        [--kind text|moe|vl|vl3|vl3moe|audio|omni3|omni25]

The command line of `relax_slurm.tiny.model` (see its docstring); `relax-train experiment=tiny_*` also builds
what it needs on first use (relax_slurm/tiny/assets.py).
"""

import sys

from relax_slurm.tiny.model import main

if __name__ == "__main__":
    sys.exit(main())
