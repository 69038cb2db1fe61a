#!/usr/bin/env bash
# One GPU session step list, run on the device machine from the repo root after the wheelhouse
# parts are installed (see README "GPU tier"). Usage: bash profiling/gpu_session.sh STEP...
#   test      pytest tests/gpu (log: $OUT/pytest.log)
#   merge     bench merge (json: $OUT/merge.json)
#   decode    bench decode, ours + FA4 + SDPA (json/png: $OUT/decode.*)
#   peers     bench decode with FlashInfer XQA and wrapper too (needs wheelhouse part c)
#   sanitize  compute-sanitizer memcheck on a few decode/merge shapes
set -o pipefail
source .wheelhouse/gpu_env.sh >/dev/null
export PYTHONUNBUFFERED=1
export CUTE_KERNELS_CACHE_DIR=${CUTE_KERNELS_CACHE_DIR:-/tmp/ck_cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    test) python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -40 ;;
    merge) python3 -m profiling.bench_merge --json "$OUT/merge.json" ;;
    decode) python3 -m profiling.bench_decode --peers fa4,sdpa --json "$OUT/decode.json" --png "$OUT/decode.png" ;;
    peers) python3 -m profiling.bench_decode --json "$OUT/decode_peers.json" --png "$OUT/decode_peers.png" ;;
    variants) python3 -m profiling.bench_decode --kv fp8 --peers bits,t128,bits128 --json "$OUT/variants.json" ;;
    occupancy) python3 -m profiling.bench_decode --kv fp8,bf16 --peers occ3,occ4,occ5,t128occ4 --quick --json "$OUT/occupancy.json" ;;
    latency) python3 -m profiling.bench_latency --json "$OUT/latency.json" ;;
    tune) python3 -m profiling.bench_decode --kv fp8 --shapes d256,d64,B8 --peers occ2,occ3,t128occ2,t128occ3 --quick --json "$OUT/tune.json" ;;
    layer) python3 -m profiling.bench_layer --json "$OUT/layer.json" ;;
    sanitize) compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m profiling.sanitize 2>&1 | tail -8
              [ -f profiling/sanitize_qsa.py ] && compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m profiling.sanitize_qsa 2>&1 | tail -8 ;;
    qsa) python3 -m profiling.bench_qsa --json "$OUT/qsa.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date +%T)"
