#!/usr/bin/env bash
# The GPU runner: named tiers run in order, each with its own time limit and log under $OUT, so
# that one hung step cannot lose the others. From the repository root on a GPU host:
#
#   bash profiling/run.sh TIER...            e.g. bash profiling/run.sh test bench
#
#   test-all    the whole GPU suite in parallel (pytest-xdist, 12 processes; pytest_all.log, pytest_all.xml)
#   test        the GPU test suite except QSA and the prefill  (log pytest.log)
#   test-qsa    the QSA GPU tests                             (log pytest_qsa.log)
#   test-hardening  the property tier, bad inputs, concurrent streams, the layer warm-up (pytest_hardening.log)
#   test-multigpu  the ops off the current device and two GPUs at once (pytest_multigpu.log); with two
#               GPUs also the contexts a process makes without the device guard (contexts_no_guard.log);
#               the device handling's host cost (host_device.log)
#   test-prefill  the SM90 prefill: the kernel alone (smoke), its GPU tests, the self-check of every
#               registered variant (logs smoke_prefill.log, pytest_prefill.log)
#   sanitize-prefill  compute-sanitizer memcheck, racecheck, synccheck and initcheck of the prefill smoke cases
#   bench-prefill  cute-kernels bench prefill (ours, both FP8 query paths, and every installed peer)
#   tune-prefill  the SM90 prefill's tuning sweep: schedules, stages, tiles, FP8 staging per kind and head dim,
#               each checked against the reference, then timed (log tune_prefill.log, tune_prefill.json)
#   smoke       a few decode split counts against the reference, in seconds
#   sanitize    compute-sanitizer memcheck, racecheck, synccheck, initcheck of the decode/merge, QSA, glue drivers
#   sanitize-sm80  compute-sanitizer memcheck, racecheck, synccheck and initcheck of the portable prefill's D 128 forms
#               (sanitize_sm80_prefill: the ping-pong default, its four-warp form, eight warps without turns, the
#               99 KB targets' 128-row ping-pong, kv_first, the LSE)
#   sanitize-cases  synccheck of the decode/merge driver one named case per process after a plain run
#               (profiling/sanitize_cases.sh; a line per case, logs synccheck_sanitize_decode_CASE.log)
#   bench       cute-kernels bench decode (uniform shapes, FP8 and BF16 with every installed peer), merge, layer, latency
#   bench-qsa   cute-kernels bench qsa --check (decode rows and prefill row tiles)
#   bench-serve  cute-kernels bench decode on the ragged and Hkv 1 shapes, then bench serve --quick
#   ncu         Nsight Compute sections of the decode (three shapes) and QSA kernels (two shapes)
#   ncu-prefill  Nsight Compute on the SM90 prefill through `cute-kernels profile prefill`: 16-bit, FP8-cache,
#               D 64 and short-batch shapes (what limits it: docs/design/sm90-prefill.md#measured--not-measured)
#   ncu-sm80    Nsight Compute on the portable prefill (`profile prefill --tuning backend=sm80`), default and lean
#               softmax, D 128 B1 S16384 and D 256 B1 S8192 (docs/design/sm80.md#open-items)
#   ncu-source  per-instruction stall samples of the QSA row-tile kernel, summarized
#   gather      the memory system's ceiling for QSA's scattered row reads
#   mma         the mma.sync m16n8k16 ceiling the portable prefill and FA2 share (docs/design/sm80.md#the-mma-ceiling)
#   schedule    static against dynamic split scheduling of the paged decode
#   clocks      SM clock and power while the 1 x 16384 QSA prefill is timed again and again
#   host        the host-side pieces of an eager paged_decode call
#
# Settings: OUT (profiling/out), CUTE_KERNELS_CACHE_DIR (/tmp/ck_cache), TAIL (lines of each log
# printed, 25), ARCHIVE=1 (pack $OUT into one results.tgz at the end). Without internet, install
# first with profiling/offline/ (this script sources install.sh when .wheelhouse/part* exist).
# What each tier's script measures: profiling/README.md.
set -o pipefail
cd "$(dirname "$0")/.."
# shellcheck source=env.sh
source profiling/env.sh || exit 2
CK=("$PY" -m cute_kernels)
MEMCHECK=(compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9)
SANITIZE=(compute-sanitizer --report-api-errors no --error-exitcode 9 --print-limit 100)
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader

step() {  # step SECONDS NAME COMMAND...: run with a time limit, log to $OUT/NAME.log, print its tail
  local limit=$1 name=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "[$name rc=$?]"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

for tier in "$@"; do
  echo "=== $tier $(date +%T)"
  case $tier in
    test-all) step 900 pytest_all "$PY" -m pytest tests/gpu -q -rfE -p no:cacheprovider -n "${WORKERS:-12}" \
                --ignore=tests/gpu/test_multi_gpu.py --junitxml="$OUT/pytest_all.xml" ;;
    test) step 420 pytest "$PY" -m pytest tests/gpu -q -p no:cacheprovider \
            --ignore=tests/gpu/test_qsa_gpu.py --ignore=tests/gpu/test_qsa_union_gpu.py \
            --ignore=tests/gpu/test_prefill_gpu.py --ignore=tests/gpu/test_prefill_kernel_gpu.py \
            --ignore=tests/gpu/test_prefill_bad_input_gpu.py \
            --ignore=tests/gpu/test_properties_gpu.py --ignore=tests/gpu/test_inputs_gpu.py \
            --ignore=tests/gpu/test_streams_gpu.py --ignore=tests/gpu/test_warmup_gpu.py \
            --ignore=tests/gpu/test_multi_gpu.py ;;
    test-qsa) step 420 pytest_qsa "$PY" -m pytest tests/gpu/test_qsa_gpu.py tests/gpu/test_qsa_union_gpu.py -q \
                -p no:cacheprovider ;;
    test-hardening) step 1500 pytest_hardening "$PY" -m pytest tests/gpu/test_properties_gpu.py \
                      tests/gpu/test_inputs_gpu.py tests/gpu/test_streams_gpu.py tests/gpu/test_warmup_gpu.py -q \
                      -p no:cacheprovider ;;
    test-multigpu) TAIL=40 step 1800 pytest_multigpu "$PY" -m pytest tests/gpu/test_multi_gpu.py -q -rs \
                     -p no:cacheprovider
                   if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
                     step 300 contexts_no_guard "$PY" -m tests.gpu.multi_gpu_worker contexts 1 --thread --no-guard
                   fi
                   step 120 host_device "$PY" -m profiling.host_device --json "$OUT/host_device.json" ;;
    test-prefill) step 300 smoke_prefill "$PY" -m profiling.smoke_prefill
                  step 580 pytest_prefill "$PY" -m pytest tests/gpu/test_prefill_kernel_gpu.py \
                    tests/gpu/test_prefill_gpu.py tests/gpu/test_prefill_bad_input_gpu.py -q -p no:cacheprovider ;;
    sanitize-prefill) for only in q_dtype=bf16,kv_dtype=bf16 q_dtype=bf16,kv_dtype=fp8 q_dtype=fp8; do
                        step 400 "memcheck_prefill_${only//[=,]/_}" "${MEMCHECK[@]}" "$PY" -m profiling.smoke_prefill \
                          --only "$only"
                        step 400 "racecheck_prefill_${only//[=,]/_}" compute-sanitizer --tool racecheck \
                          --racecheck-report hazard --error-exitcode 9 "$PY" -m profiling.smoke_prefill --only "$only"
                        for tool in synccheck initcheck; do
                          step 400 "${tool}_prefill_${only//[=,]/_}" "${SANITIZE[@]}" --tool "$tool" "$PY" -m \
                            profiling.smoke_prefill --only "$only"
                        done
                      done ;;
    bench-prefill) TAIL=60 step 580 prefill "${CK[@]}" bench prefill --json "$OUT/prefill.json" --png "$OUT/prefill.png" ;;
    tune-prefill) TAIL=150 step 500 tune_prefill "$PY" -m profiling.tune_prefill --json "$OUT/tune_prefill.json" ;;
    smoke) step 120 smoke "$PY" -m profiling.smoke_decode ;;
    sanitize) for d in sanitize_decode sanitize_qsa sanitize_glue; do  # compile outside the sanitizer first
                step 600 "${d}_plain" "$PY" -m "profiling.$d"
              done
              for tool in memcheck racecheck synccheck initcheck; do
                extra=()
                [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
                for d in sanitize_decode sanitize_qsa sanitize_glue; do
                  step 900 "${d}_$tool" "${SANITIZE[@]}" --tool "$tool" "${extra[@]}" "$PY" -m "profiling.$d"
                done
              done ;;
    sanitize-sm80) step 300 sanitize_sm80_plain "$PY" -m profiling.sanitize_sm80_prefill
                   for tool in memcheck racecheck synccheck initcheck; do
                     step 400 "${tool}_sm80_prefill" "${SANITIZE[@]}" --tool "$tool" "$PY" -m profiling.sanitize_sm80_prefill
                   done ;;
    sanitize-cases) TAIL=40 step 1800 sanitize_cases env OUT="$OUT" PYTHON="$PY" bash profiling/sanitize_cases.sh \
                      synccheck profiling.sanitize_decode ;;
    bench) TAIL=40 step 420 decode_fp8 "${CK[@]}" bench decode --shapes ctx --kv fp8 --peers xqa,xqa_nopdl,fi,sdpa \
             --json "$OUT/decode_fp8.json" --png "$OUT/decode_fp8.png"
           TAIL=40 step 500 decode_bf16 "${CK[@]}" bench decode --shapes ctx --kv bf16 --peers xqa,fi,fa4,sdpa \
             --json "$OUT/decode_bf16.json" --png "$OUT/decode_bf16.png"
           step 120 merge "${CK[@]}" bench merge --json "$OUT/merge.json"
           step 200 layer "${CK[@]}" bench layer --json "$OUT/layer.json"
           step 200 latency "${CK[@]}" bench latency --json "$OUT/latency.json" ;;
    bench-qsa) TAIL=40 step 400 qsa "${CK[@]}" bench qsa --check --json "$OUT/qsa.json" ;;
    bench-serve) TAIL=60 step 500 decode_ragged "${CK[@]}" bench decode --shapes ragged,70b --kv fp8,bf16 \
                   --peers xqa,fi,fa4 --json "$OUT/decode_ragged.json" --png "$OUT/decode_ragged.png"
                 TAIL=60 step 580 serve_quick "${CK[@]}" bench serve --quick --json "$OUT/serve_quick.json" \
                   --png "$OUT/serve_quick.png" ;;
    ncu) for sh in "qwen3-30b B8 ctx32000" "d256 h16/8 B32 ctx8192" "llama3-8b B1 ctx1000"; do
           "$PY" -m profiling.ncu_decode --shape "$sh" > /dev/null 2>&1  # compile outside the profiler
           name="ncu_decode_$(echo "${sh%% *}_${sh##* }" | tr -c 'a-zA-Z0-9_\n-' _)"
           TAIL=60 step 150 "$name" ncu --clock-control none --kernel-name regex:decode --launch-skip 3 \
             --launch-count 1 "${NCU_SECTIONS[@]}" "$PY" -m profiling.ncu_decode --shape "$sh"
         done
         for spec in "decode-bf16-256 3 1" "prefill-bf16-4096 6 2"; do
           set -- $spec  # shape, launches to skip, launches to profile (prefill: union pre-pass + tiles)
           "$PY" -m profiling.ncu_qsa --shape "$1" > /dev/null 2>&1
           TAIL=120 step 150 "ncu_qsa_$1" ncu --clock-control none --kernel-name regex:ssm90qsa --launch-skip "$2" \
             --launch-count "$3" "${NCU_SECTIONS[@]}" --section ComputeWorkloadAnalysis \
             "$PY" -m profiling.ncu_qsa --shape "$1"
         done ;;
    ncu-prefill) for sh in B=1,new=16384 B=1,new=16384,kv=fp8 B=1,new=8192,D=64 B=16,new=512; do
                   name="ncu_prefill_$(echo "$sh" | tr -c 'a-zA-Z0-9_\n-' _)"
                   TAIL=60 step 300 "$name" "${CK[@]}" profile prefill --shape "$sh" --out "$OUT/$name" \
                     --ncu-args "--clock-control none"
                 done ;;
    ncu-sm80) for tn in plain:backend=sm80 lean:backend=sm80,lean_softmax=true; do  # the portable prefill, D 128 and 256
                for sh in B=1,new=16384 B=1,new=8192,D=256,Hkv=8,Hq=16; do
                  name="ncu_sm80_prefill_${tn%%:*}_$(echo "$sh" | tr -c 'a-zA-Z0-9_\n-' _)"
                  TAIL=60 step 300 "$name" "${CK[@]}" profile prefill --shape "$sh" --tuning "${tn#*:}" \
                    --out "$OUT/$name" --ncu-args "--clock-control none --section ComputeWorkloadAnalysis --section SchedulerStats"
                done
              done ;;
    ncu-source) for sh in prefill-bf16-4096 prefill-fp8-4096; do
                  "$PY" -m profiling.ncu_qsa --shape "$sh" > /dev/null 2>&1
                  step 150 "ncu_source_$sh" ncu --clock-control none --kernel-name regex:tile_kernel --launch-skip 3 \
                    --launch-count 1 --section SourceCounters --section WarpStateStats -o "$OUT/ncu_source_$sh" \
                    "$PY" -m profiling.ncu_qsa --shape "$sh"
                  ncu -i "$OUT/ncu_source_$sh.ncu-rep" --page source --csv --print-source sass \
                    | gzip > "$OUT/ncu_source_${sh}_sass.csv.gz"
                  step 60 "hotspots_$sh" "$PY" -m profiling.ncu_sass_hotspots "$OUT/ncu_source_${sh}_sass.csv.gz"
                done ;;
    gather) step 200 gather "$PY" -m profiling.gather_ceiling --json "$OUT/gather.json" ;;
    mma) step 200 mma "$PY" -m profiling.mma_peak --json "$OUT/mma_peak.json" ;;
    schedule) step 300 schedule "$PY" -m profiling.split_schedule --json "$OUT/schedule.json" ;;
    clocks) step 200 clocks_bf16 "$PY" -m profiling.probe_clocks --kv bf16 --rounds 4 --json "$OUT/clocks_bf16.json"
            step 200 clocks_fp8 "$PY" -m profiling.probe_clocks --kv fp8 --rounds 3 --json "$OUT/clocks_fp8.json" ;;
    host) step 120 host "$PY" -m profiling.host_costs --json "$OUT/host.json" ;;
    *) echo "unknown tier $tier (the list is at the top of profiling/run.sh)"; exit 2 ;;
  esac
done
if [ "${ARCHIVE:-0}" = 1 ]; then
  tar -C "$OUT" -czf /tmp/results.tgz --exclude=results.tgz . && mv /tmp/results.tgz "$OUT/results.tgz"
  echo "packed $OUT/results.tgz"
fi
echo "=== done $(date +%T)"
