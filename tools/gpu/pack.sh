#!/usr/bin/env bash
# pack.sh: fill .gpu/ in this relax-slurm checkout with what a GPU host without network access
# needs, so that `bash .gpu/run.sh [CMD...]`, run there from a copy of the tree that includes
# .gpu/, runs the project. Run from anywhere in the checkout:   bash tools/gpu/pack.sh
# (docs/development.md, "GPU runs")
#
# .gpu/ gets: the wheels of the runtime dependencies the GPU image lacks (py3.12, manylinux
# x86_64; list below, checked against the GPU image's package list), the project's own wheel
# (console scripts; run.sh puts the checkout's source first on PYTHONPATH), src.tar.gz (the
# working tree: tracked + untracked-not-ignored files, for calls that send another repo),
# run.sh, MANIFEST.txt. Downloads are cached in $RELAX_GPU_CACHE (default
# ~/.cache/relax-gpu-kit): a second pack only rebuilds the project's wheel (seconds).
set -euo pipefail

kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(git rev-parse --show-toplevel 2>/dev/null)" || { echo "pack.sh: not in a git checkout" >&2; exit 2; }
cd "$root"
grep -q '^name = relax-slurm' setup.cfg 2>/dev/null \
  || { echo "pack.sh: $root is not a relax-slurm checkout (setup.cfg)" >&2; exit 2; }

PY="${PYTHON:-python3}"
# the GPU host's Python; another one (RELAX_GPU_PYVER=3.11) only for a dry run of run.sh on a CPU
pyver="${RELAX_GPU_PYVER:-3.12}"
cache="${RELAX_GPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/relax-gpu-kit}/wheels-py$pyver"
dest="$root/.gpu"
mkdir -p "$cache"

# 1. .gpu/ is in .gitignore (so out of the normal tree; copy it along explicitly)
grep -qxF '/.gpu/' .gitignore || { echo "pack.sh: .gitignore lacks /.gpu/" >&2; exit 2; }

# 2. what the GPU image lacks. setup.cfg install_requires vs KINDS.md's list: torch,
# transformers, tokenizers, safetensors, numpy, packaging, msgpack, httpx, tqdm, regex, sympy,
# pyarrow, pandas, fsspec, xxhash, huggingface-hub, anyio, h11, click, cloudpickle, annotated-doc,
# pyyaml, requests are there. Versions: the ones the CPU CI venv runs (tests green).
# Left out on purpose (not imported by the text demos; add them here if you need them):
#   av (~35 MiB; video/audio data only, relax_slurm/data/video.py imports it lazily),
#   wandb (metrics.wandb only), msgspec/pybase64/aiohttp (dev extra: SGLang contract tests),
#   sglang, megatron-core, transformer-engine (gpu extra; heavy, and need CUDA builds).
REQS=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  pyzmq==27.3.0
  fastapi==0.165.0
  opentelemetry-api==1.45.2       # fastapi 0.165 imports it
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  typing-inspection==0.4.5
  annotated-types==0.8.0
  typing-extensions==4.16.0       # the image has one; pydantic 2.14 wants a recent one
  sniffio==1.3.1
  uvicorn==0.54.0
  submitit==1.5.4
  math-verify==0.9.0
  latex2sympy2-extended==1.11.0
  mathruler==0.1.0
  pylatexenc==2.11
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  pillow==12.1.0                  # install_requires (images); light
  pytest==9.0.3                   # run.sh suite: the gpu-marked tests
  pluggy==1.6.0
  iniconfig==2.3.0
  pytest-timeout==2.4.0
)
SDIST_REQS=(antlr4-python3-runtime==4.9.3)  # sdist only on PyPI (hydra, omegaconf, math-verify)
PLAT=(--python-version "$pyver" --implementation cp --abi "cp${pyver/./}" --abi abi3 --abi none
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }
cached() {  # the cached wheel of NAME==VERSION, if any
  local n v; n="$(norm "${1%%==*}")"; v="${1##*==}"
  find "$cache" -maxdepth 1 -iname "${n}-${v}-*.whl" | head -1
}

echo "pack.sh: wheels (cache $cache)"
missing=()
for req in "${REQS[@]}"; do [ -n "$(cached "$req")" ] || missing+=("$req"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "  downloading ${#missing[@]}: ${missing[*]}"
  # one pip call for all (each call spends seconds on index lookups); one by one if it fails
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$cache" "${missing[@]}" 2>/dev/null \
    || for req in "${missing[@]}"; do
         [ -n "$(cached "$req")" ] \
           || "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$cache" "$req" \
           || { echo "pack.sh: no py$pyver manylinux x86_64 wheel for $req" >&2; exit 3; }
       done
fi
for req in "${SDIST_REQS[@]}"; do  # pure Python, sdist only: build a py3 wheel here
  [ -n "$(cached "$req")" ] && continue
  echo "  building a wheel of $req from its sdist"
  tmp="$(mktemp -d)"
  "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$tmp" "$req"
  for w in "$tmp"/*.whl; do
    case "$w" in *-py3-none-any.whl|*-py2.py3-none-any.whl) mv "$w" "$cache/";;
      *) echo "pack.sh: $req built a platform wheel ($w): not portable to the GPU host" >&2; exit 3;;
    esac
  done
  rm -rf "$tmp"
done
for req in "${REQS[@]}" "${SDIST_REQS[@]}"; do
  [ -n "$(cached "$req")" ] || { echo "pack.sh: no wheel for $req in $cache" >&2; exit 3; }
done

# 3. assemble .gpu/ afresh (one version of each wheel: two stop the install there)
rm -rf "$dest"; mkdir -p "$dest"
for req in "${REQS[@]}" "${SDIST_REQS[@]}"; do cp "$(cached "$req")" "$dest/"; done

# the working tree as it is (tracked + untracked, not ignored; relax_slurm/conf stays a
# symlink): the project's wheel is built from a clean copy of it (no stale build/), and the
# copy also travels as src.tar.gz
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/src"
git ls-files -z --cached --others --exclude-standard | grep -zv '^\.gpu/' \
  | tar --null -cf - -T - 2>/dev/null | tar -xf - -C "$stage/src"
tar -czf "$dest/src.tar.gz" -C "$stage/src" .
echo "pack.sh: building the project's wheel"
# in a cached build venv without isolation: an isolated build fetches setuptools each time
benv="$(dirname "$cache")/buildenv"
"$benv/bin/python" -c 'import setuptools, wheel' 2>/dev/null \
  || { "$PY" -m venv "$benv" && "$benv/bin/python" -m pip install -q "setuptools>=68" wheel; }
"$benv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$stage/src" \
  >"$stage/wheel.log" 2>&1 \
  || { cat "$stage/wheel.log" >&2; echo "pack.sh: pip wheel . failed" >&2; exit 4; }
# (grep -c reads everything: grep -q would close the pipe early and fail it under pipefail)
[ "$(unzip -Z1 "$dest"/relax_slurm-*.whl | grep -c '^relax_slurm/conf/train.yaml$')" = 1 ] \
  || { echo "pack.sh: the project's wheel lacks relax_slurm/conf/*.yaml" >&2; exit 4; }

cp "$kit/run.sh" "$dest/run.sh"
{
  echo "relax-slurm GPU kit, packed $(date -u +%FT%TZ) from $root"
  echo "HEAD $(git rev-parse HEAD)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
  (cd "$dest" && ls -l --block-size=K -- *.whl src.tar.gz | awk '{print $5, $9}')
} > "$dest/MANIFEST.txt"
size=$(du -sk "$dest" | cut -f1)
echo "pack.sh: $dest: $(ls "$dest"/*.whl | wc -l) wheels, $((size / 1024)) MiB in all"
if [ "$size" -gt $((50 * 1024)) ]; then
  echo "pack.sh: WARNING: over 50 MiB; the tree and .gpu/ travel together, 64 MiB at most" >&2
fi
echo "pack.sh: next: on the GPU host, from a copy of this tree with .gpu/: bash .gpu/run.sh [CMD...]"
