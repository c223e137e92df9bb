"""Write the multimodal tasks of the tiny CPU demos: coloured squares, colour changes, tones,
videos with sound.

    python tools/prepare_mm_data.py --out tiny --task colors|change|tones|sounding

The command line of `relax_slurm.tiny.media_tasks` (see its docstring); `relax-train experiment=tiny_*` also builds
what it needs on first use (relax_slurm/tiny/assets.py).
"""

import sys

from relax_slurm.tiny.media_tasks import main

if __name__ == "__main__":
    sys.exit(main())
