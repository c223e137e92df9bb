#!/usr/bin/env bash
# run.sh: runs ON the GPU host, from the root of the tree copied there (with .gpu/):
#     bash .gpu/run.sh                 the tiny GPU smoke (below)
#     bash .gpu/run.sh smoke [K=V...]  the smoke with more Hydra overrides
#     bash .gpu/run.sh suite           every smoke the image allows: the torch trainer in fp32
#                                      and bf16, SFT, async LoRA, megatron (plain, with the KL
#                                      reference and chunked log-probs, LoRA) when the image
#                                      has megatron-core
#     bash .gpu/run.sh CMD [ARGS...]   any command (here; $RELAX_GPU_PROJ: the source), kit on the path
# Installs .gpu/*.whl into $RELAX_GPU_SITE (/tmp/site), puts the project's source first on
# PYTHONPATH (the checkout copied there, else .gpu/src.tar.gz unpacked in /tmp/relax-src),
# prints the machine and versions, runs, and leaves in $OUT: run_sh.log (all of this output)
# and runs.tar.gz (every run directory under /tmp/relax-smoke, without checkpoints or tiny
# models). Nested calls (RELAX_GPU_READY=1, e.g. from a script run by run.sh) skip the setup.
set -uo pipefail

kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
SITE="${RELAX_GPU_SITE:-/tmp/site}"
RUNS="${RELAX_GPU_RUNS:-/tmp/relax-smoke}"
SMOKE_TIMEOUT="${RELAX_GPU_SMOKE_TIMEOUT:-180}"
export OUT="${OUT:-/tmp/relax-gpu-out}"
mkdir -p "$OUT" "$RUNS"

stamp() { echo "=== run.sh [$(( $(date +%s) - ${RELAX_GPU_T0:-$(date +%s)} ))s] $*"; }

smoke() {  # smoke [OVERRIDES...]: a tiny preset ($RELAX_GPU_EXPERIMENT, tiny_cpu) on one GPU,
           # 20 steps, in $RUNS/$RELAX_GPU_NAME
  local name="${RELAX_GPU_NAME:-smoke}" experiment="${RELAX_GPU_EXPERIMENT:-tiny_cpu}"
  rm -rf "${RUNS:?}/$name"
  mkdir -p "$RUNS/work"
  # one GPU: the trainer takes cuda:0 (NCCL default group, world 1); the hf engine runs on CPU
  # (the launcher never passes it --device), so weight_sync.backend=auto takes gloo for it
  # (NCCL would need the engine on a GPU of its own and a CUDA receive buffer).
  local args=("experiment=$experiment" trainer.nproc_per_node=1 trainer.total_steps=20
              "run_dir=$RUNS/$name" "$@")
  stamp "smoke '$name': relax-train ${args[*]} (timeout ${SMOKE_TIMEOUT}s)"
  # the tiny model and data are built on first use under ./tiny of the working directory
  local spy=""
  if command -v nvidia-smi >/dev/null; then  # who holds GPU memory, each time it changes
    ( prev=""; while sleep 2; do
        now="$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null \
               | while IFS=', ' read -r pid mem unit; do
                   echo -n "$pid($(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | cut -c1-60)) $mem$unit; "
                 done)"
        [ "$now" != "$prev" ] && echo "  [gpu] ${now:-no process on the GPU}" && prev="$now"
      done ) & spy=$!
  fi
  (cd "$RUNS/work" && timeout -s INT -k 20 "$SMOKE_TIMEOUT" relax-train "${args[@]}")
  local rc=$?
  [ -n "$spy" ] && kill "$spy" 2>/dev/null
  stamp "smoke '$name' ended rc=$rc"
  where "$RUNS/$name"
  return $rc
}

suite() {  # every smoke this image can run; rc 1 if any failed
  local rc=0
  RELAX_GPU_NAME=torch smoke || rc=1
  RELAX_GPU_NAME=torch_bf16 smoke model.dtype=bfloat16 || rc=1
  RELAX_GPU_NAME=sft RELAX_GPU_EXPERIMENT=tiny_sft_cpu smoke || rc=1
  # LoRA, async: versioned adapter names, adapter-only syncs while generation goes on
  RELAX_GPU_NAME=lora_async smoke model.lora.rank=8 algo.max_staleness=1 || rc=1
  if "$PY" -c 'import megatron.core, megatron.bridge' 2>/dev/null; then
    RELAX_GPU_NAME=megatron smoke trainer=megatron || rc=1
    # the sharded KL reference, log-probs over chunks of the sequence, megatron's LoRA
    RELAX_GPU_NAME=megatron_kl smoke trainer=megatron algo.kl_loss_coef=0.01 \
      trainer.logprob_chunk_size=8 || rc=1
    RELAX_GPU_NAME=megatron_lora smoke trainer=megatron model.lora.rank=8 || rc=1
  else
    stamp "megatron: megatron-core/megatron-bridge not in this image: skipped"
  fi
  stamp "gpu tests: python -m pytest -m gpu"
  (cd "$RELAX_GPU_PROJ" && timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
     tests/unit/trainer/test_collectives.py tests/unit/engines/test_sglang_contract.py) || rc=1
  stamp "suite: rc=$rc"
  return $rc
}

where() {  # where RUN_DIR: how far a run got, and the end of every traceback in its role logs
  local d="$1"
  [ -d "$d" ] || { echo "  (no run directory $d)"; return; }
  local n=0; [ -f "$d/metrics.jsonl" ] && n=$(grep -c . "$d/metrics.jsonl")
  echo "  got to: $n step(s) logged in metrics.jsonl; checkpoints: $(ls "$d/checkpoints" 2>/dev/null | tr '\n' ' ')"
  if [ -f "$d/summary.json" ]; then
    echo "  summary: $(tr -d '\n ' < "$d/summary.json" | cut -c1-300)"
  else  # no summary: it failed or hung; what the trainer said last
    echo "  trainer's last line: $(grep -v '^\s*$' "$d/logs/trainer.log" 2>/dev/null | tail -1 | cut -c1-200)"
  fi
  local f
  for f in "$d"/logs/*.log; do
    [ -f "$f" ] || continue
    grep -q 'Traceback (most recent call last)' "$f" || continue
    echo "  --- $(basename "$f"): errors: $(grep -E -o '^(\[rank[0-9]+\]: )?[A-Za-z_.]*(Error|Exception|Interrupt)[A-Za-z_.]*:.{0,120}' "$f" | sort -u | tr '\n' '|')"
    if grep -q '^\[rank[0-9]*\]: Traceback' "$f"; then  # a rank's own traceback, not torchrun's
      awk '/^\[rank[0-9]*\]: Traceback/{p=1} p && /^\[rank/{print} p && /^\[rank[0-9]*\]: [A-Za-z_.]*(Error|Exception)/{exit}' "$f"
    else
      awk '/Traceback \(most recent call last\)/{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$f"
    fi | grep -v '^\(\[rank[0-9]*\]: \)\?\s*[\^~]*$' | tail -14 | sed 's/^/    /'
  done
}

collect() {
  tar -czf "$OUT/runs.tar.gz" --exclude='checkpoints' --exclude='hf' --exclude='work/tiny' --exclude='secret' --exclude='spill.bin' \
    -C "$(dirname "$RUNS")" "$(basename "$RUNS")" 2>/dev/null
  stamp "collected $(du -h "$OUT/runs.tar.gz" | cut -f1) into $OUT/runs.tar.gz"
}

if [ "${RELAX_GPU_READY:-}" != 1 ]; then
  export RELAX_GPU_T0="$(date +%s)"
  exec > >(tee -a "$OUT/run_sh.log") 2>&1
  stamp "setup on $(hostname), $(date -u +%FT%TZ); kit $kit"
  [ -f "$kit/MANIFEST.txt" ] && head -2 "$kit/MANIFEST.txt"
  if grep -q '^name = relax-slurm' setup.cfg 2>/dev/null; then
    PROJ="$PWD"
  elif [ -f "$kit/src.tar.gz" ]; then
    PROJ=/tmp/relax-src; rm -rf "$PROJ"; mkdir -p "$PROJ"; tar -xzf "$kit/src.tar.gz" -C "$PROJ"
  else
    echo "run.sh: no relax-slurm source (not in a checkout, no $kit/src.tar.gz)"; exit 2
  fi
  stamp "install $(ls "$kit"/*.whl | wc -l) wheels into $SITE; source $PROJ"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$kit"/*.whl 2>&1 | grep -v 'WARNING: Target directory' \
    ; [ "${PIPESTATUS[0]}" = 0 ] || { echo "run.sh: FAILED at: pip install of the wheels"; exit 3; }
  export RELAX_GPU_PROJ="$PROJ" RELAX_GPU_SITE="$SITE" RELAX_GPU_READY=1 PYTHONUNBUFFERED=1
  export PYTHONPATH="$PROJ:$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
  stamp "machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "(no nvidia-smi)"
  "$PY" - <<'EOF' 2>&1
import importlib, importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as e:
    print("torch import failed:", e)
names = ["transformers", "tokenizers", "safetensors", "huggingface-hub", "numpy", "pyarrow",
         "fsspec", "pandas", "httpx", "anyio", "sympy", "msgpack", "hydra-core", "pydantic",
         "fastapi", "datasets", "pyzmq", "relax-slurm"]
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print(" ".join(f"{n}={v(n)}" for n in names))
EOF
  "$PY" - <<'EOF' 2>&1
import importlib, relax_slurm
print("relax_slurm from", relax_slurm.__file__)
bad = []
for m in ["relax_slurm.launch.cli", "relax_slurm.broker.server", "relax_slurm.engines.hf.__main__",
          "relax_slurm.rollout.worker", "relax_slurm.trainer.main", "relax_slurm.rewards.math",
          "relax_slurm.data.dataset", "relax_slurm.checkpoint.cli"]:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {type(e).__name__}: {e}")
print("imports:", "all ok" if not bad else "FAILED\n  " + "\n  ".join(bad))
EOF
  which relax-train >/dev/null || { echo "run.sh: FAILED at: no relax-train on PATH"; exit 3; }
  top=1
fi

if [ $# -eq 0 ] || [ "$1" = smoke ]; then
  [ $# -gt 0 ] && shift
  smoke "$@"; rc=$?
elif [ "$1" = suite ]; then
  suite; rc=$?
else
  stamp "run in $PWD (source: $RELAX_GPU_PROJ): $*"
  "$@"; rc=$?
fi

if [ "${top:-}" = 1 ]; then
  collect
  stamp "done, rc=$rc"
fi
exit $rc
