"""python abandoned_update.py --model-dir D --out F

An engine left waiting in a weight update its sender gave up midway (what a survivor sees when
another engine of the cohort died during a broadcast): trainer rank 0's side forms a group,
asks the engine for two tensors and broadcasts only the first. It then forms the next cohort's
group and sends the full weights on it. The engine must drop the abandoned update at once and
take the new one, not hold its model until its weight-sync timeout (120 s here). JSON to --out.
"""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import (free_port, script_args, start_engine, stop_process,  # noqa: E402
                          wait_healthy)

from relax_slurm.errors import EngineError  # noqa: E402
from relax_slurm.weightsync import WeightSender  # noqa: E402
from relax_slurm.weightsync.bucket import dtype_name  # noqa: E402

ENGINE_SYNC_TIMEOUT_S = 120


def main() -> None:
    model_dir, named, out_path = script_args()
    weights = [(n, t + 0.25) for n, t in named]
    port, log = free_port(), out_path.with_suffix(".engine.log")
    url = f"http://127.0.0.1:{port}"
    engine = start_engine(model_dir, port, log,
                          ["--weight-sync-timeout-s", str(ENGINE_SYNC_TIMEOUT_S)])
    out = {}
    pool = ThreadPoolExecutor(1)
    try:
        wait_healthy(url, engine, 180, log)
        first = WeightSender([url], "127.0.0.1", free_port(), "relax_test_abandon", "gloo", 60,
                             512, pause_for_sync=False)
        first.connect()
        (n1, t1), (n2, t2) = weights[:2]
        client = first.clients[0]
        client.begin_weight_update()  # left open: the second sender's send must recover it
        stuck = pool.submit(client.update_weights_from_distributed, [n1, n2],
                            [dtype_name(t1.dtype), dtype_name(t2.dtype)],
                            [list(t1.shape), list(t2.shape)], "relax_test_abandon", "1")
        dist.broadcast(t1.contiguous(), src=0, group=first._pg)  # and never the second
        time.sleep(2.0)
        out["stuck_done_before"] = stuck.done()

        second = WeightSender([url], "127.0.0.1", free_port(), "relax_test_abandon_c1", "gloo",
                              60, 512, pause_for_sync=False)
        t0 = time.monotonic()
        second.connect()
        second.send(weights, version=2)
        out["new_update_s"] = time.monotonic() - t0
        second.verify(weights)  # raises unless bit for bit
        out["verified"] = True
        try:
            stuck.result(timeout=30)
            out["stuck_error"] = None
        except EngineError as e:
            out["stuck_error"] = str(e)
        out["version"] = second.clients[0].weight_version()
        second.close()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        stop_process(engine)
        out_path.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
