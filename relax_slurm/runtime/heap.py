"""Keep Python's cyclic garbage collector off the heap a role built at start-up.

A role that imported torch and transformers holds ~300k long-lived objects; a full collection
walks all of them (0.2-2 s on these 2 cores), and a step's allocations (samples, requests,
JSON) trigger one every few dozen steps: a periodic stall of the whole pipeline. Freezing moves
what exists now into a permanent generation the collector never scans; objects made later are
collected as usual.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Call once a role has imported and loaded everything it keeps for its lifetime."""
    gc.collect()  # garbage from start-up goes now, not frozen forever
    gc.freeze()
