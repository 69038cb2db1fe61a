#!/usr/bin/env bash
# Installing without internet, step 1 (on a machine that has it): download every wheel the GPU
# tiers and benchmarks need beyond what the GPU host already has (torch, triton, numpy), and cut
# them into folders small enough for the host's file transfers.
#
#   bash profiling/offline/make_wheelhouse.sh            # from the repository root
#
# Settings (environment):
#   PY=3.12         the GPU host's Python (wheels are chosen for CPython PY on x86-64 Linux)
#   CUDA=13         13 or 12: which build of the DSL's libraries (the host driver's CUDA major)
#   PEERS=1         0 leaves out FlashInfer and FA4 (bench decode then skips those peers)
#   PART_MIB=48     the largest part folder: a transfer that also carries the repository must fit
#   DEST=.wheelhouse
#
# Result: DEST/part1, part2, ... each at most PART_MIB, with a manifest. A wheel larger than a
# part is unpacked, packed again as one xz stream (wheels are deflate-compressed; the stream is
# smaller) and cut into pieces that go to different parts. Step 2 is profiling/offline/install.sh
# on the GPU host. DEST is ignored by git (.gitignore).
set -euo pipefail
PY=${PY:-3.12}
CUDA=${CUDA:-13}
PEERS=${PEERS:-1}
PART_MIB=${PART_MIB:-48}
DEST=${DEST:-.wheelhouse}
DSL=$(sed -n 's/.*"nvidia-cutlass-dsl==\([^"]*\)".*/\1/p' pyproject.toml | head -1)
[ -n "$DSL" ] || { echo "run from the repository root (pyproject.toml pins nvidia-cutlass-dsl)" >&2; exit 2; }
case $CUDA in 12|13) ;; *) echo "CUDA must be 12 or 13" >&2; exit 2 ;; esac

wheels=(
  "nvidia-cutlass-dsl==$DSL" "nvidia-cutlass-dsl-libs-base==$DSL" "nvidia-cutlass-dsl-libs-core==$DSL"
  "nvidia-cutlass-dsl-libs-cu$CUDA==$DSL" "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5" "nvtx==0.2.16"
)
if [ "$PEERS" = 1 ]; then
  wheels+=("flashinfer-python==0.7.2.post1" "flash-attn-4==4.0.0b36" "quack-kernels==0.6.5")
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/dl" "$work/out"
pyver=${PY/./}
for w in "${wheels[@]}"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/dl" \
    --python-version "$PY" --implementation cp --abi "cp$pyver" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$w"
done

limit=$((PART_MIB * 1024 * 1024))
piece=$((limit / 2))  # a piece leaves room for small wheels beside it
for f in "$work"/dl/*.whl; do
  name=$(basename "$f")
  if [ "$(stat -c %s "$f")" -le "$piece" ]; then
    cp "$f" "$work/out/"
    continue
  fi
  echo "repacking $name (a few minutes)..."
  mkdir "$work/x"
  python3 -m zipfile -e "$f" "$work/x"
  tar -C "$work/x" -cf - . | xz -9 -T0 > "$work/$name.tar.xz"
  split -b "$piece" -d -a 2 "$work/$name.tar.xz" "$work/out/$name.tar.xz.piece"
  rm -rf "$work/x" "$work/$name.tar.xz"
done

# first fit, largest first: each part folder stays under the limit
rm -rf "$DEST"
mkdir -p "$DEST"
parts=0
declare -A used
while read -r size file; do
  target=""
  for ((i = 1; i <= parts; i++)); do
    if [ $((used[$i] + size)) -le "$limit" ]; then target=$i; break; fi
  done
  if [ -z "$target" ]; then parts=$((parts + 1)); target=$parts; used[$target]=0; mkdir -p "$DEST/part$target"; fi
  used[$target]=$((used[$target] + size))
  mv "$file" "$DEST/part$target/"
done < <(find "$work/out" -type f -printf '%s %p\n' | sort -rn)

# the manifest (every file's sha256, its part in the path) goes into every part: install.sh
# knows from whichever part came first what it still waits for
(cd "$DEST" && find . -mindepth 2 -type f -printf '%P\n' | sort | xargs sha256sum) > "$work/MANIFEST.sha256"
echo "# CUDA=$CUDA PY=$PY DSL=$DSL" >> "$work/MANIFEST.sha256"
for d in "$DEST"/part*; do cp "$work/MANIFEST.sha256" "$d/"; done
du -sh "$DEST"/part*
echo "copy each $DEST/partN to the GPU host's repository (same path), then: source profiling/offline/install.sh"
