"""relax-convert: convert checkpoints between DCP, Hugging Face and (from) Megatron.

    relax-convert --input RUN_DIR/checkpoints/step_100 --output hf_step100          # DCP -> HF
    relax-convert --input Qwen3-4B --output qwen3_dcp                               # HF -> DCP
    relax-convert --input megatron_ckpt/iter_0000100 --output hf --hf-config Qwen3-4B
    relax-convert --input RUN_DIR --output adapter --to peft     # model.lora: the adapter alone

The input format is detected; `--to` picks the output (default: hf for DCP and Megatron
input, dcp for HF input). A run directory as input means its latest complete checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from relax_slurm.errors import RelaxError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relax-convert", description=__doc__.splitlines()[0],
        epilog="\n".join(__doc__.splitlines()[1:]), formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, type=Path,
                   help="checkpoint directory (DCP step_<N>, HF model, Megatron iter_*) or run dir")
    p.add_argument("--output", required=True, type=Path, help="directory to write")
    p.add_argument("--to", choices=("hf", "dcp", "peft"), default=None,
                   help="output format (default: hf, or dcp when the input is HF); peft: a "
                        "model.lora run's adapter as a PEFT directory (hf: merged into the base)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="cast floating-point weights (default auto: keep each tensor's dtype)")
    p.add_argument("--hf-config", default=None,
                   help="HF model dir or hub id giving architecture and tokenizer (default: the "
                        "checkpoint's hf/ copy, or model.path from its meta.json); for a "
                        "model.lora checkpoint --to hf, the base model (default its model.path)")
    p.add_argument("--shard-size-mb", type=float, default=5000.0,
                   help="largest safetensors shard of an HF output, MiB (default 5000)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow model classes from the config's repository code")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from relax_slurm.checkpoint.convert import convert_checkpoint
    from relax_slurm.checkpoint.formats import detect_format

    try:
        fmt, src = detect_format(args.input)
        target = args.to or ("dcp" if fmt == "hf" else "hf")
        print(f"converting {src} ({fmt}) -> {args.output} ({target})", file=sys.stderr)
        out = convert_checkpoint(args.input, args.output, to=args.to, dtype=args.dtype,
                      hf_config=args.hf_config, progress=not args.no_progress,
                      overwrite=args.overwrite, shard_size_mb=args.shard_size_mb,
                      trust_remote_code=args.trust_remote_code)
    except RelaxError as e:
        print(f"relax-convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
