"""python weights_by_reference.py --model-dir D --out F --url URL

weight_sync.transport=tensor against the engine at URL (real SGLang or an hf engine): trainer rank 0's TensorSender hands it other weights by reference
(/update_weights_from_tensor, shared memory on CPU), one tensor per pickle and as flattened
buckets, and the engine's greedy log-probs must be exactly those it gives for the same weights
broadcast over a gloo group (WeightSender). JSON to --out:
  broadcast0  log-probs of D's weights, broadcast (version "4")
  tensor1     after the other weights by reference (version "5")
  broadcast1  after the same weights broadcast (version "6")
  tensor0     after D's weights again by reference, flattened buckets (version "7")
  versions    /model_info's label after each push
  tensor_stats  the first push by reference's stats
  shared      whether any of the sender's source tensors was moved into shared memory
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ for helpers_tiny
from helpers_tiny import engine_script_args, free_port  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from relax_slurm.engines.client import EngineClient  # noqa: E402
from relax_slurm.weightsync import WeightSender  # noqa: E402
from relax_slurm.weightsync.tensor_sender import TensorSender  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def logprobs(client: EngineClient) -> list[float]:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    out = client._json("/generate", client._call("POST", "/generate", body))
    return [float(lp) for lp, *_ in out["meta_info"]["output_token_logprobs"]]


def main() -> None:
    args = engine_script_args()
    # the shared-memory manager torch starts for the first CPU tensor by reference inherits
    # this process's stdout and stderr, and lives as long as the engine holds what it opened:
    # not run_script's pipes, or its read would wait for the engine's end
    log = os.open(args.out.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    served = list(load_file(str(args.model_dir / "model.safetensors")).items())
    other = [(n, t * 1.5 + 0.01) for n, t in served]
    out: dict = {"versions": []}
    client = EngineClient(args.url, 60.0)

    def push(kind, weights, version, load_format=None):
        cls = TensorSender if kind == "tensor" else WeightSender
        sender = cls([args.url], "127.0.0.1", free_port(), f"relax_test_ref_{version}", "gloo",
                     60.0, bucket_mb=0.05, pause_mode="retract", load_format=load_format)
        sender.connect()
        try:
            stats = sender.send(weights, version=version)
        finally:
            if kind != "tensor":
                sender.destroy_on_engines()
            sender.close()
        out["versions"].append(client.weight_version())
        return stats

    push("distributed", served, 4)  # whatever the engine served before
    out["broadcast0"] = logprobs(client)
    out["tensor_stats"] = push("tensor", other, 5)
    out["tensor1"] = logprobs(client)
    push("distributed", other, 6)
    out["broadcast1"] = logprobs(client)
    push("tensor", served, 7, load_format="flattened_bucket")
    out["tensor0"] = logprobs(client)
    out["shared"] = any(t.is_shared() for _, t in served + other)
    client.close()
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
