"""`python -m relax_slurm.engines.hf`: the hf engine's command line. It loads the
model into an `HFEngine` (core.py: a CPU inference server wrapping transformers, speaking
SGLang's native HTTP API), starts its generation thread and serves the routes of server.py
with uvicorn until stopped.

  python -m relax_slurm.engines.hf --model-path P --host H --port N --dtype float32 \
      --max-batch-size 1024 --batch-wait-ms 5 --torch-threads 1 --seed S --weight-version 0
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from typing import Optional

import torch
import uvicorn

from relax_slurm.config.check import default_of
from relax_slurm.config.data import DataConfig
from relax_slurm.data.processor import MediaLimits
from relax_slurm.runtime.exit import exit_now
from relax_slurm.runtime.heap import freeze_heap
from relax_slurm.runtime.stacks import RUN_DIR_ENV, register_stack_dumps
from relax_slurm.engines import sglang_api
from relax_slurm.engines.hf.core import HFEngine
from relax_slurm.engines.hf.server import build_app

log = logging.getLogger("relax_slurm.hf_engine")

# idle keep-alive connections live this long (uvicorn's 5 s default races with clients that
# reuse a connection after a pause between training steps)
KEEP_ALIVE_S = 120


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m relax_slurm.engines.hf",
                                description="transformers inference server with SGLang's API")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch-size", type=int, default=1024)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="longest a /generate call may wait for its batch")
    p.add_argument("--weight-sync-timeout-s", type=float, default=300.0,
                   help="timeout of group formation, broadcasts and waiting for the model lock")
    # data.*'s media keys, same names and defaults (config/data.py DataConfig)
    data = functools.partial(default_of, DataConfig)
    p.add_argument("--image-min-pixels", type=int, default=data("image_min_pixels"),
                   help="multimodal: smallest image size in pixels (default: the processor's)")
    p.add_argument("--image-max-pixels", type=int, default=data("image_max_pixels"),
                   help="multimodal: largest image size in pixels (default: the processor's)")
    p.add_argument("--audio-sampling-rate-hz", type=int, default=data("audio_sampling_rate_hz"))
    p.add_argument("--video-fps", type=float, default=data("video_fps"),
                   help="multimodal: frames kept per second of a video")
    p.add_argument("--video-min-frames", type=int, default=data("video_min_frames"))
    p.add_argument("--video-max-frames", type=int, default=data("video_max_frames"))
    p.add_argument("--video-max-pixels", type=int, default=data("video_max_pixels"),
                   help="multimodal: largest video frame in pixels (default: the image limit)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: answer return_routed_experts=true with "
                        "meta_info.routed_experts (SGLang's flag)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters loaded by /load_lora_adapter_from_tensors and "
                        "named by /generate's lora_path (SGLang's flag)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if args.max_batch_size < 1:
        p.error("--max-batch-size must be >= 1")
    # its stacks on SIGUSR2 (relax-ctl dump) when the launcher started it: named by its port,
    # which roles.json maps back to the role's name (engine0, teacher0)
    register_stack_dumps(os.environ.get(RUN_DIR_ENV), f"engine-{args.port}")

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    engine = HFEngine(args.model_path, args.tokenizer_path, args.dtype, args.device,
                      args.max_batch_size, args.batch_wait_ms, args.weight_version,
                      args.weight_sync_timeout_s,
                      MediaLimits.of(args),  # the flags carry data.*'s names
                      return_routed_experts=args.enable_return_routed_experts,
                      enable_lora=args.enable_lora)
    freeze_heap()
    engine.start()
    log.info("serving %s on %s:%d (max batch %d, wait %.1f ms)", args.model_path, args.host,
             args.port, args.max_batch_size, args.batch_wait_ms)
    try:
        app = build_app(engine, args.request_timeout_s, api_key=sglang_api.api_key())
        uvicorn.run(app, host=args.host, port=args.port,
                    log_level="warning", timeout_graceful_shutdown=5,
                    timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        engine.shutdown()
    exit_now(0)  # uvicorn stopped and nothing is written: skip the interpreter's teardown


if __name__ == "__main__":
    main()
