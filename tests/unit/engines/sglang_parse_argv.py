"""python sglang_parse_argv.py < argvs.json  (PYTHONPATH holding an SGLang release's sources)

Parses each launch line (the flags after `python -m sglang.launch_server`) with that release's
own `prepare_server_args`, and prints, per line, the parsed values of the flags the launcher
sets, as JSON. SGLang's dependencies that do not install on CPU are not needed to parse: triton
is stubbed (as for megatron-bridge), nothing is resolved against a device or a model."""

import json
import sys

from relax_slurm.trainer.megatron.cpu_compat import install_triton_stub

FIELDS = ("model_path", "host", "port", "base_gpu_id", "tp_size", "ep_size",
          "mem_fraction_static", "dtype", "random_seed", "weight_version", "trust_remote_code",
          "enable_memory_saver", "enable_deterministic_inference", "api_key", "context_length",
          "enable_return_routed_experts", "device", "attention_backend", "disable_cuda_graph",
          "skip_server_warmup", "max_total_tokens", "sleep_on_idle", "mm_process_config",
          "nccl_port")


def main() -> None:
    install_triton_stub()
    from sglang.srt.server_args import prepare_server_args
    from sglang.version import __version__

    out = []
    for argv in json.load(sys.stdin):
        args = prepare_server_args(argv)
        out.append({f: getattr(args, f) for f in FIELDS})
    print(json.dumps({"version": __version__, "parsed": out}))


if __name__ == "__main__":
    main()
