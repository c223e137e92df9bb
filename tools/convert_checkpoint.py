"""Convert checkpoints: DCP <-> Hugging Face, Megatron -> Hugging Face.

    python tools/convert_checkpoint.py --input RUN_DIR/checkpoints/step_100 --output hf_out

Same as the `relax-convert` console script; see docs/checkpoints.md and --help.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from relax_slurm.checkpoint.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
