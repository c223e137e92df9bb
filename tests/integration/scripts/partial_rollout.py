"""python partial_rollout.py --model-dir D --out F

A rollout worker's group generated across a weight sync in weight_sync.pause_mode=abort, against
a real hf engine (rollout.partial_rollout=true, the default): the sync aborts the group's running
sequences mid-way, the worker continues them from their prefix on the new weights, and the
samples record both versions. What this finds, for the test to judge:
- each sample's version spans, tokens and log-probs;
- the prefix against a straight run on the old weights with the same seeds, and the rest against
  the engine continuing prompt + prefix on the new weights (with the derived seed): both are
  the same computations (same rows, same batch shapes), so tokens and log-probs must agree;
- the wire round trip of the group, and what the broker's staleness rule does with it.
JSON to --out.
"""

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import free_port, perturbed, script_engine  # noqa: E402

from relax_slurm.broker.state import BrokerState  # noqa: E402
from relax_slurm.broker.wire import decode, encode  # noqa: E402
from relax_slurm.config.data import DataConfig
from relax_slurm.config.model import ModelConfig
from relax_slurm.config.reward import RewardConfig
from relax_slurm.config.rollout import RolloutConfig
from relax_slurm.config.schema import TrainConfig
from relax_slurm.config.weight_sync import WeightSyncConfig
from relax_slurm.runtime.plan import RunPlan, save_plan  # noqa: E402
from relax_slurm.engines.client import EngineClient  # noqa: E402
from relax_slurm.rollout.partial import resume_params  # noqa: E402
from relax_slurm.rollout.sampling import sample_seed  # noqa: E402
from relax_slurm.rollout.worker import RolloutWorker  # noqa: E402
from relax_slurm.weightsync import WeightSender  # noqa: E402

ROWS, MAX_NEW = 4, 300  # long enough that the sync lands mid-way (the model has 512 positions)
ATTEMPTS = 3  # a sync that comes after the group already ended is tried again


class Collector:
    """Stands in for the broker client: keeps the groups the worker puts."""

    def __init__(self) -> None:
        self.groups: list = []

    async def put_group(self, group) -> None:
        self.groups.append(group)

    def close(self) -> None:
        pass


def make_worker(model_dir: Path, url: str, run_dir: Path) -> RolloutWorker:
    run_dir.mkdir(parents=True, exist_ok=True)
    data = run_dir / "train.jsonl"
    data.write_text(json.dumps({"prompt": "12+34=", "label": "46"}) + "\n")
    cfg = TrainConfig(
        run_dir=str(run_dir), model=ModelConfig(path=str(model_dir)), seed=3,
        rollout=RolloutConfig(batch_size=1, n_samples_per_prompt=ROWS, max_new_tokens=MAX_NEW),
        data=DataConfig(train_files=[str(data)], apply_chat_template=False, shuffle=False,
                        num_epochs=ATTEMPTS),
        reward=RewardConfig(name="exact_match", num_workers=1, timeout_s=30.0),
        weight_sync=WeightSyncConfig(pause_mode="abort"))
    save_plan(RunPlan(broker_router="tcp://127.0.0.1:1", broker_pub="tcp://127.0.0.1:2",
                      engine_urls=[url]), run_dir)
    worker = RolloutWorker(cfg, run_dir)
    worker.services.broker.close()
    worker.services.broker = Collector()
    # the tiny random model samples EOS every ~16 tokens: make the generations long
    worker.services.params["ignore_eos"] = True
    return worker


def sync_when_running(url: str, sender: WeightSender, weights, version: int,
                      done: threading.Event) -> None:
    """Once the group's batch has a few tokens, the trainer's sync (pause abort, update,
    continue); nothing if the batch ended first."""
    while not done.is_set():
        if httpx.get(url + "/server_info", timeout=10).json()["running_tokens"] >= 2 * ROWS:
            sender.send(weights, version=version)
            return
        time.sleep(0.005)


async def one_attempt(worker: RolloutWorker, client: EngineClient, url: str,
                      sender: WeightSender, weights, version: int, gid: int) -> dict:
    prompt = next(worker.dataset)
    params = [{**worker.services.params, "sampling_seed": sample_seed(worker.cfg.seed, gid, i, ROWS)}
              for i in range(ROWS)]
    straight = client.generate([prompt.input_ids] * ROWS, params)  # the old weights, no sync
    done = threading.Event()
    sync = asyncio.create_task(asyncio.to_thread(sync_when_running, url, sender, weights,
                                                 version, done))
    await worker.mode.rollout_group(prompt, gid, {})
    done.set()
    await sync
    group = worker.services.broker.groups[-1]
    found = {"spans": [s.version_spans for s in group],
             "versions": [[s.version_min, s.version] for s in group],
             "lengths": [[len(s.response_ids), len(s.rollout_logprobs)] for s in group],
             "finish": [s.finish_reason for s in group],
             "multi_version": [s.multi_version for s in group]}
    if not all(s.multi_version for s in group):
        return found
    # the prefix: the straight run's first k tokens, log-probs of the same computation
    cuts = [s.version_spans[0][2] for s in group]
    found["prefix_same_tokens"] = all(
        s.response_ids[:k].tolist() == r.output_ids[:k] for s, r, k in zip(group, straight, cuts))
    found["prefix_logprob_gap"] = max(
        float(abs(s.rollout_logprobs[:k] - torch.tensor(r.logprobs[:k]).numpy()).max())
        for s, r, k in zip(group, straight, cuts))
    # the rest: the engine continuing prompt + prefix now, with the derived seeds
    rest = client.generate([[*prompt.input_ids, *s.response_ids[:k].tolist()]
                            for s, k in zip(group, cuts)],
                           [resume_params(p, k) for p, k in zip(params, cuts)])
    found["rest_same_tokens"] = all(
        s.response_ids[k:].tolist() == r.output_ids for s, r, k in zip(group, rest, cuts))
    found["rest_logprob_gap"] = max(
        float(abs(s.rollout_logprobs[k:] - torch.tensor(r.logprobs).numpy()).max())
        for s, r, k in zip(group, rest, cuts))
    found["rest_versions"] = sorted({r.weight_version for r in rest})
    # through the broker's wire (and so its spill file) unchanged
    _, _, [back] = decode(encode("put_group", {}, [group]))
    found["wire_spans_equal"] = [s.version_spans for s in back] == found["spans"]
    found["staleness"] = staleness_rule(group, version)
    return found


def staleness_rule(group, newest: int) -> dict:
    """What broker/state.py does with the group at max_staleness=1: judged by its oldest
    version (newest - 1), taken at trainer version `newest`, dropped at `newest + 1` (where its
    newest version alone would still pass)."""
    out = {}
    for trainer_version in (newest, newest + 1):
        state = BrokerState(max_staleness=1, batch_size=1)
        state.set_version(newest)
        state.admit(1)
        state.accept(group)
        taken = state.take_batch(1, trainer_version)
        out[str(trainer_version)] = {
            "taken": taken is not None, "dropped": state.counters()["dropped"],
            "staleness_max": taken[1].staleness_max if taken else None}
    return out


async def run(worker: RolloutWorker, client: EngineClient, url: str, named, new) -> dict:
    sender = WeightSender([url], "127.0.0.1", free_port(), "relax_test_partial", "gloo", 60, 512,
                          pause_mode="abort")
    sender.connect()
    await worker.services.reward_pool.start()
    try:
        for attempt in range(ATTEMPTS):  # each attempt syncs to the next version
            found = await one_attempt(worker, client, url, sender,
                                      new if attempt % 2 == 0 else named, attempt + 1, attempt)
            found["attempt"] = attempt
            if all(found["multi_version"]):
                return found
        return found
    finally:
        sender.close()
        await worker.aclose()  # in this loop: its connections belong to it


def main() -> None:
    with script_engine() as s:
        worker = make_worker(s.model_dir, s.url, s.out_path.parent / "run")
        s.out.update(asyncio.run(run(worker, s.client, s.url, s.named, perturbed(s.named, 5))))


if __name__ == "__main__":
    main()
