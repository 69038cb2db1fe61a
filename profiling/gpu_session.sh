#!/usr/bin/env bash
# One GPU session step list, run on the device machine from the repo root after the wheelhouse
# parts are installed (see README "GPU tier"). Usage: bash profiling/gpu_session.sh STEP...
# Every step has its own time limit and log under $OUT, so a hung step cannot lose the others.
#   test       pytest tests/gpu except QSA           (log: $OUT/pytest.log)
#   testqsa    pytest tests/gpu/test_qsa_gpu.py      (log: $OUT/pytest_qsa.log)
#   merge      bench merge                           (json: $OUT/merge.json)
#   decode     bench decode, ours + FA4 + SDPA       (json/png: $OUT/decode.*)
#   peers      bench decode with FlashInfer XQA and wrapper too (needs wheelhouse part c)
#   layervar   bench layer at T 4096/65536: rows per thread 1, 2, 4; with and without PDL
#   pdl        decode with and without programmatic dependent launch, every shape
#   final      FP8 decode, ours (with and without PDL) on the shapes that were short of a target
#   sched      split scheduling: static ranges vs dynamic tile chunks, forced split counts
#   tune       decode tuning variants on a few shapes
#   latency    small-batch latency, host costs, split sweep
#   layer      bench layer (quantize_query, write_kv_cache, layer step in a graph)
#   ncu        Nsight Compute sections of the FP8 decode on the shapes that miss targets
#   qsa        bench qsa
#   qsatile    union pre-pass + row-tile tests, then prefill bench: per-row kernel vs row tiles
#   ncuqsa     Nsight Compute sections of the QSA decode (BF16 N 256) and row-tile prefill kernels
#   qsasmall   small-N decode: ncu durations of the split kernel and the merge (BF16 N 1, FP8 N 4), split-count sweep
#   mergeqsa   merge tests + QSA tests, bench merge, small-N QSA split sweep (after a merge change)
#   qsatable   small/mid-N QSA decode split counts (the config table's inputs)
#   qsapdl     small-N QSA decode with and without programmatic dependent launch of the split kernel
#   qsatune    row-tile warp-role / tile variants at 1x16384 (correlated) after the epilogue fixes, and ncu
#              sections of the FP8 per-row decode at N 256
#   qsatests   every QSA GPU test and the QSA sanitizer run (fits one 600 s call on a fresh machine)
#   overlap    row-tile GPU tests, QSA sanitizer, prefill A/B of the overlapped consumer (FP8's default since the A/B)
#   qsabench   bench qsa --check and the row-tile role variants at 1x16384 BF16
#   qsaprod    decode A/B of the per-row kernel's gather warps (1 vs 2, twice, interleaved)
#   qsa2wg     row-tile GPU tests, prefill bench of the row-tile kernel's warp-role variants
#   ncusrc     per-instruction (SASS) stall samples of the row-tile kernel, BF16 and FP8 1x4096
#   qsav3      every QSA GPU test, the QSA sanitizer run, bench qsa --check (time-boxed for a short budget)
#   qsaclose   the QSA sanitizer run and bench qsa (with --check)
#   qsafinal   every QSA GPU test, the QSA sanitizer run, bench qsa, decode with 4 producer warps
#   probe7     random-chunk gather bandwidth, small-N QSA split sweep, FP8 row tiles with one gather group
#   ncurow     Nsight Compute of the per-row QSA decode kernel at N 64 (FP8, BF16): L2 breakdown, SASS stalls
#   order11    FP8 QSA decode: the same config timed four times in a row, with SM clock / power samples
#   final7     bench qsa --check (every shape, the first timing of each problem discarded)
#   peers7     bench decode FP8 with XQA (with and without PDL) and the FlashInfer wrapper (needs wheelhouse part c)
#   deep12     FP8 QSA decode with one CTA per SM and a deeper gather ring (4 or 6 stages)
#   d256v7     FP8 decode D 256 (and D 64) sized for 3 CTAs/SM against XQA and the old 2-CTA sizing (needs part c)
#   l2qsa      QSA decode time against the tiles per row (valid_count caps) from HBM and with every row selecting
#              the same tokens (L2-resident): per-tile and fixed costs of the per-row kernel
#   slope13    QSA decode time against valid_count caps (HBM, N 16/64), one L2-resident tile, forced split counts
#   probe8     first-timing artifact with CUDA_MODULE_LOADING=EAGER vs LAZY (FP8 QSA decode); Llama B64 q4 decode x3
#   widen9     FP8 prefill row tiles on a widened 16-bit copy: GPU tests, then prefill A/B against widening per row
#   strided9   decode split CTAs taking strided tiles (first page-table load with seq_len): decode GPU tests, A/B
#   final9     decode GPU tests (strided default) and the FP8 decode side by side with XQA / FlashInfer (needs part c)
#   rerun9     1x16384 correlated prefill (BF16, FP8) timed three times each in one process; FP8 decode B1/B8 again
#   splits9    Qwen3 B8 FP8 decode: split counts and CTA sizing around the schedule's 12 x 3/SM, twice
#   gate13     QSA decode with and without the output gate (1-tile and full rows, N 64/256)
#   diag10     QSA decode N 4: time against valid_count caps (HBM and L2-resident), ncu of its split kernel and
#              merge (BF16); ncu of the Llama B1 FP8 paged decode (warm caches, unlocked clocks)
#   cluster10  decode GPU tests with the cluster merge (DSMEM) default, then A/B against the global fused merge
#              (and the cluster at 2 CTAs/SM sizing, at 8 splits) on the split shapes, twice
#   final10    decode GPU tests (cluster merge for small split grids), decode memcheck, A/B cluster vs global merge
#   peers10    FP8 decode side by side with XQA / FlashInfer and the global-merge variant (needs part c)
#   sanitize   compute-sanitizer memcheck on decode/merge and QSA shapes
#   final11    decode GPU tests (a cluster launch takes the split count, no merge workspace), decode memcheck,
#              A/B cluster vs global merge on the split shapes
#   peers11f   FP8 decode side by side with XQA (with and without PDL), FlashInfer and SDPA, with accuracy (part c)
#   peers11b   BF16 decode side by side with XQA, FlashInfer, FA4 and SDPA, with accuracy (needs part c)
#   dtest12    decode + merge GPU tests (K/V loads evict-first, TMA descriptors prefetched)
#   evict12    decode A/B, every shape: default against evict_first=0 / prefetch_desc=0 / both
#   qevict12   QSA forced-split and evict-first GPU tests, then decode A/B of the gather with the L2
#              evict-first policy (default, evict_first=1, default)
#   mgroup13a  all QSA GPU tests on the merge whose load group follows the split count
#   mgroup13b  QSA decode N 1/4/16 A/B of that merge against groups of 8 (interleaved, twice); the
#              row-tile prefill 1 x 16384 A/B of the L2 evict-first gather
#   kvbar13a   all QSA GPU tests and the QSA memcheck with the per-row gather's separate K and V barriers
#   kvbar13b   QSA decode A/B of the separate K/V barriers (default) against one barrier per slot
#   peers13    FP8 and BF16 decode side by side with the peers (needs part c)
#   final13    the QSA tests of the K/V release rule and the forced splits, then the QSA decode table
#   lanes14    (branch next/qsa-merge-lanes) QSA merge with several threads per row chunk: its GPU tests and
#              the decode N 1 (33 splits: 4 lanes by default there) and N 4 A/B
#   rel14      (branch next/unsplit-release) unsplit QSA launches that release the next kernel early (pdl + release 1/2): the chained
#              GPU test, then the decode A/B at N 64/256 (interleaved, twice)
#   final15a   every QSA GPU test and the QSA memcheck, on the tree the issue closes with
#   final15b   every other GPU test (decode, merge, glue, layer, probe), then the whole QSA table (--check)
#   lanes15    small-N QSA decode: the merge with 2 and 4 lanes per chunk at N 4 (S 11), twice, interleaved
#   clocks15   SM clock, power and clock-event reasons sampled while the 1x16384 prefill is timed 4x (graph, eager)
#   confirm15  1x16384 correlated prefill three times (clocks and power sampled around each), then the decode table
#   final14a   every QSA GPU test (per-row, merge lanes, row tiles, union pre-pass) and the QSA memcheck
#   final14b   the QSA decode table (--check), then an A/B of 4 gather warps per CTA at N 4/16/64
#   eager13    the eager B1 call, two processes: its variance study and its launch forms (cluster merge,
#              global merge, no PDL, one split), each with graph, eager and host time
#   retest12a/b  retest12 in two calls of under 600 s: (a) the GPU tests, (b) memcheck, A/B and latency
#   retest12   (next session) decode + merge GPU tests, the QSA plain-gather test, decode memcheck, Qwen3 B8
#              A/B and B1 latency on the
#              staged merge whose LSE loads changed after the twelfth session's GPU runs
#   final12    Llama B1 graph/eager latency (default launch) and the QSA decode table (--check)
#   smem12     decode + merge GPU tests, then Qwen3 B8 A/B (twice): the fused merge staged in shared memory
#              against merging from L2 in rounds, and against the eleventh session's kernel
set -o pipefail
source .wheelhouse/gpu_env.sh >/dev/null
export PYTHONUNBUFFERED=1
export CUTE_KERNELS_CACHE_DIR=${CUTE_KERNELS_CACHE_DIR:-/tmp/ck_cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
run() { local limit=$1 name=$2; shift 2; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "[$name rc=$?]"; tail -${TAIL:-25} "$OUT/$name.log"; }
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    test) run 240 pytest python3 -m pytest tests/gpu -q -p no:cacheprovider --ignore=tests/gpu/test_qsa_gpu.py ;;
    testglue) run 200 pytest_glue python3 -m pytest tests/gpu/test_glue_gpu.py tests/gpu/test_layer_gpu.py -q -p no:cacheprovider ;;
    testqsa) run 200 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider ;;
    merge) run 120 merge python3 -m profiling.bench_merge --json "$OUT/merge.json" ;;
    decode) run 200 decode python3 -m profiling.bench_decode --peers fa4,sdpa --json "$OUT/decode.json" --png "$OUT/decode.png" ;;
    peers) TAIL=80 run 300 peers python3 -m profiling.bench_decode --json "$OUT/decode_peers.json" --png "$OUT/decode_peers.png" ;;
    layervar) run 300 layervar python3 -m profiling.bench_layer --tokens 4096,65536 --variants "items=1;items=2;items=4;items=2,pdl=0;items=1,pdl=0" --json "$OUT/layervar.json" ;;
    pdl) run 200 pdl python3 -m profiling.bench_decode --kv fp8,bf16 --peers nopdl --quick --json "$OUT/pdl.json" ;;
    final) run 200 final python3 -m profiling.bench_decode --kv fp8 --shapes B1,B8,d64,d256 --peers nopdl --quick --json "$OUT/final.json" ;;
    sched) run 300 sched python3 -m profiling.bench_schedule --json "$OUT/sched.json" ;;
    tune) run 200 tune python3 -m profiling.bench_decode --kv fp8 --shapes d64,B8 --peers t128occ3,t128occ2,occ4 --quick --json "$OUT/tune.json" ;;
    latency) run 150 latency python3 -m profiling.bench_latency --json "$OUT/latency.json" ;;
    layer) run 150 layer python3 -m profiling.bench_layer --json "$OUT/layer.json" ;;
    qsa) run 200 qsa python3 -m profiling.bench_qsa --check --json "$OUT/qsa.json" ;;
    qsatile) run 240 pytest_tile python3 -m pytest tests/gpu/test_qsa_union_gpu.py tests/gpu/test_qsa_gpu.py -q -x \
               -p no:cacheprovider
             run 150 qsatile_prefill python3 -m profiling.bench_qsa --kinds prefill --kv fp8,bf16 --prefill-t 1024,4096,16384 \
               --selection correlated,independent --check --json "$OUT/qsatile_prefill.json" ;;
    qsa2wg) run 240 pytest_2wg python3 -m pytest tests/gpu/test_qsa_union_gpu.py tests/gpu/test_qsa_gpu.py -q -x \
              -k "row_tiles or union" -p no:cacheprovider
            TAIL=40 run 200 qsa2wg python3 -m profiling.bench_qsa --kinds prefill --kv bf16,fp8 --prefill-t 16384 \
              --selection correlated,independent --tuning "consumers=2;producers=8,gather_groups=2;tile=32,consumers=2;tile=32,producers=8,gather_groups=2" --json "$OUT/qsa2wg.json" ;;
    qsav3) run 200 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py tests/gpu/test_qsa_union_gpu.py -q \
             -p no:cacheprovider
           run 80 sanitize_qsa compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
             python3 -m profiling.sanitize_qsa
           TAIL=40 run 150 qsa python3 -m profiling.bench_qsa --check --json "$OUT/qsa.json" ;;
    qsaclose) run 150 sanitize_qsa compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                python3 -m profiling.sanitize_qsa
              TAIL=40 run 240 qsa python3 -m profiling.bench_qsa --check --json "$OUT/qsa.json" ;;
    qsafinal) run 240 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py tests/gpu/test_qsa_union_gpu.py -q \
                -p no:cacheprovider
              run 150 sanitize_qsa compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                python3 -m profiling.sanitize_qsa
              TAIL=40 run 200 qsa python3 -m profiling.bench_qsa --check --json "$OUT/qsa.json"
              run 90 qsa_p4 python3 -m profiling.bench_qsa --kinds decode --tuning "producers=4" --json "$OUT/qsa_p4.json" ;;
    ncuqsa) for spec in "decode-bf16-256 3 1" "prefill-bf16-4096 6 2"; do
              set -- $spec  # shape, launches to skip, launches to profile (prefill: union pre-pass + tiles)
              python3 -m profiling.ncu_qsa --shape $1 > /dev/null 2>&1  # compile outside the profiler
              TAIL=120 run 150 "ncu_qsa_$1" ncu --clock-control none --kernel-name regex:"ssm90qsa" --launch-skip $2 \
                --launch-count $3 --section SpeedOfLight --section Occupancy --section WarpStateStats \
                --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis python3 -m profiling.ncu_qsa --shape $1
            done ;;
    ncusrc) for sh in prefill-bf16-4096 prefill-fp8-4096; do  # per-instruction stall samples of the row-tile kernel
              python3 -m profiling.ncu_qsa --shape $sh > /dev/null 2>&1  # compile outside the profiler
              run 100 "ncusrc_$sh" ncu --clock-control none --kernel-name regex:tile_kernel --launch-skip 3 --launch-count 1 \
                --section SourceCounters --section WarpStateStats -o "$OUT/ncusrc_$sh" python3 -m profiling.ncu_qsa --shape $sh
              ncu -i "$OUT/ncusrc_$sh.ncu-rep" --page source --csv --print-source sass > "$OUT/ncusrc_${sh}_sass.csv" 2>&1
              ls -la "$OUT/ncusrc_${sh}_sass.csv"; head -c 600 "$OUT/ncusrc_${sh}_sass.csv"; echo
            done ;;
    qsasmall) for sh in decode-bf16-1 decode-fp8-4; do  # 2 launches per call: the split kernel, the merge
                python3 -m profiling.ncu_qsa --shape $sh > /dev/null 2>&1
                TAIL=60 run 100 "ncu_qsa_$sh" ncu --clock-control none --kernel-name regex:qsa --launch-skip 6 \
                  --launch-count 2 --section SpeedOfLight --section LaunchStats --section Occupancy \
                  --section WarpStateStats python3 -m profiling.ncu_qsa --shape $sh
              done
              TAIL=40 run 120 qsasmall python3 -m profiling.bench_qsa --kinds decode --kv bf16,fp8 --decode-n 1,4,16 \
                --tuning ";splits=8;splits=17;splits=24" --json "$OUT/qsasmall.json" ;;
    mergeqsa) run 240 pytest_mq python3 -m pytest tests/gpu/test_merge_gpu.py tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider
              run 120 merge python3 -m profiling.bench_merge --json "$OUT/merge.json"
              TAIL=40 run 150 qsasweep python3 -m profiling.bench_qsa --kinds decode --kv bf16,fp8 --decode-n 1,4,16,64 \
                --tuning ";splits=8;splits=11;splits=17;splits=24;splits=33" --json "$OUT/qsasweep.json" ;;
    qsatable) TAIL=40 run 150 qsatable python3 -m profiling.bench_qsa --kinds decode --kv bf16,fp8 --decode-n 4,16,64 \
                --tuning ";splits=1;splits=2;splits=4;splits=8;splits=11" --json "$OUT/qsatable.json" ;;
    qsapdl) TAIL=30 run 120 qsapdl python3 -m profiling.bench_qsa --kinds decode --kv bf16,fp8 --decode-n 1,4,16,64 \
              --tuning ";pdl=0" --json "$OUT/qsapdl.json" ;;
    qsatune) TAIL=30 run 150 qsatune python3 -m profiling.bench_qsa --kinds prefill --kv bf16,fp8 --prefill-t 16384 \
               --selection correlated --tuning "consumers=2,producers=4,gather_groups=1;consumers=1,producers=8,gather_groups=2;tile=32" \
               --json "$OUT/qsatune.json"
             python3 -m profiling.ncu_qsa --shape decode-fp8-256 > /dev/null 2>&1
             TAIL=80 run 100 ncu_qsa_decode-fp8-256 ncu --clock-control none --kernel-name regex:"ssm90qsa" --launch-skip 3 \
               --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
               --section MemoryWorkloadAnalysis python3 -m profiling.ncu_qsa --shape decode-fp8-256 ;;
    qsatests) run 320 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py tests/gpu/test_qsa_union_gpu.py -q \
                -p no:cacheprovider
              run 150 sanitize_qsa compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                python3 -m profiling.sanitize_qsa ;;
    overlap) run 200 pytest_overlap python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider -k row_tiles
             run 100 sanitize_qsa compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
               python3 -m profiling.sanitize_qsa
             TAIL=12 run 150 overlap_fp8 python3 -m profiling.bench_qsa --kinds prefill --kv fp8 --prefill-t 4096,16384 \
               --selection correlated,independent --check \
               --tuning ";overlap=0;consumers=1,producers=4,gather_groups=1,overlap=1" --json "$OUT/overlap_fp8.json"
             TAIL=6 run 100 overlap_bf16 python3 -m profiling.bench_qsa --kinds prefill --kv bf16 --prefill-t 16384 \
               --selection correlated --tuning ";consumers=1,producers=8,gather_groups=2;consumers=1,producers=8,gather_groups=2,overlap=1;consumers=1,producers=4,gather_groups=1,overlap=1" \
               --json "$OUT/overlap_bf16.json" ;;
    qsabench) TAIL=40 run 150 qsa python3 -m profiling.bench_qsa --check --json "$OUT/qsa.json"
              TAIL=10 run 100 gatherroles python3 -m profiling.bench_qsa --kinds prefill --kv bf16 --prefill-t 16384 \
                --selection correlated --tuning "consumers=1,producers=4;consumers=1,producers=8,gather_groups=2" \
                --json "$OUT/gatherroles.json" ;;
    probe7) TAIL=14 run 120 gather python3 -m profiling.bench_gather --json "$OUT/gather.json"
            TAIL=30 run 150 smalln python3 -m profiling.bench_qsa --kinds decode --kv bf16,fp8 --decode-n 1,4,16 \
              --tuning ";splits=16;splits=32;splits=6" --json "$OUT/smalln.json"
            TAIL=10 run 150 fp8groups python3 -m profiling.bench_qsa --kinds prefill --kv fp8 --prefill-t 4096,16384 \
              --selection correlated,independent --tuning ";gather_groups=1" --json "$OUT/fp8groups.json" ;;
    ncurow) for sh in decode-fp8-64 decode-bf16-64; do  # per-row kernel, one CTA per SM: throughput breakdown + SASS stalls
              python3 -m profiling.ncu_qsa --shape $sh > /dev/null 2>&1  # compile outside the profiler
              TAIL=100 run 150 "ncurow_$sh" ncu --clock-control none --kernel-name regex:"ssm90qsa" --launch-skip 3 \
                --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
                --section SourceCounters --print-details all -o "$OUT/ncurow_$sh" python3 -m profiling.ncu_qsa --shape $sh
              ncu -i "$OUT/ncurow_$sh.ncu-rep" --page source --csv --print-source sass > "$OUT/ncurow_${sh}_sass.csv" 2>&1
              ncu -i "$OUT/ncurow_$sh.ncu-rep" --print-details all > "$OUT/ncurow_${sh}_details.txt" 2>&1
              rm -f "$OUT/ncurow_$sh.ncu-rep"
            done ;;
    order11) (nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
                --format=csv -lms 50 > "$OUT/smi.csv" 2>&1 &)
             TAIL=20 run 200 order python3 -m profiling.bench_qsa --kinds decode --kv fp8 --decode-n 64,256 \
               --tuning ";splits=1;;splits=1" --json "$OUT/order.json"
             TAIL=8 run 200 order_decode python3 -m profiling.bench_decode --kv fp8 --shapes "d256,B8" --peers occ3 --quick \
               --json "$OUT/order_decode.json"
             pkill -f "nvidia-smi --query-gpu" ; sleep 0.2
             python3 - "$OUT/smi.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
body = [r for r in rows[1:] if len(r) >= 6]
print(len(body), "samples; clock MHz / power W / throttle reasons, every 10th:")
for r in body[::10]:
    print(" ".join(x.strip() for x in r[1:]))
PY
             ;;
    final7) TAIL=40 run 300 qsa python3 -m profiling.bench_qsa --check --json "$OUT/qsa.json" ;;
    peers7) TAIL=40 run 300 peers7 python3 -m profiling.bench_decode --kv fp8 --peers xqa,xqa_nopdl,fi --quick \
              --json "$OUT/decode_peers7.json" ;;
    deep12) run 200 warm_qsa python3 -m profiling.warm_variants qsa "occupancy=1,stages=6;occupancy=1,stages=4" fp8_e4m3
            TAIL=20 run 200 deep python3 -m profiling.bench_qsa --kinds decode --kv fp8 --decode-n 16,64,256 \
              --tuning ";occupancy=1,stages=6;occupancy=1,stages=4" --json "$OUT/deep.json" ;;
    d256v7) TAIL=12 run 200 d256 python3 -m profiling.bench_decode --kv fp8 --shapes "d256,d64" --peers xqa,xqa_nopdl,occ2 \
              --json "$OUT/d256.json" ;;
    l2qsa) TAIL=30 run 200 slope python3 -m profiling.bench_qsa --kinds decode --kv fp8,bf16 --decode-n 64 \
             --decode-counts 64,1024,2051 --json "$OUT/slope.json"
           TAIL=40 run 200 l2 python3 -m profiling.bench_qsa --kinds decode --kv fp8,bf16 --decode-n 64,128,256 --decode-shared \
             --decode-counts 1024,2051 --json "$OUT/l2.json"
           TAIL=20 run 200 dram128 python3 -m profiling.bench_qsa --kinds decode --kv fp8,bf16 --decode-n 128 --splits 1 \
             --json "$OUT/dram128.json" ;;
    slope13) TAIL=30 run 200 slope python3 -m profiling.bench_qsa --kinds decode --kv fp8,bf16 --decode-n 16,64 \
               --decode-counts 64,1024,2051 --json "$OUT/slope.json"
             TAIL=30 run 200 l2one python3 -m profiling.bench_qsa --kinds decode --kv fp8 --decode-n 64 --decode-shared \
               --decode-counts 64 --json "$OUT/l2one.json"
             TAIL=60 run 300 splits13 python3 -m profiling.bench_qsa --kinds decode --kv fp8,bf16 --decode-n 16,64,128 \
               --splits 1,2,3,4,8 --json "$OUT/splits13.json" ;;
    probe8) for m in EAGER LAZY; do
              TAIL=8 run 200 first_$m env CUDA_MODULE_LOADING=$m python3 -m profiling.bench_qsa --kinds decode --kv fp8 \
                --decode-n 64,256 --json "$OUT/first_$m.json"
            done
            for i in 1 2 3; do
              TAIL=6 run 150 q4_$i python3 -m profiling.bench_decode --kv fp8 --shapes q4 --peers nopdl --quick \
                --json "$OUT/q4_$i.json"
            done ;;
    widen9) run 300 pytest_widen python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider -x \
              -k "widened or graph_replay"
            TAIL=30 run 240 widen python3 -m profiling.bench_qsa --kinds prefill --kv fp8 --prefill-t 1024,4096,16384 \
              --selection correlated,independent --tuning ";widen=0;;widen=0" --check --json "$OUT/widen.json"
            TAIL=8 run 100 widen_bf16 python3 -m profiling.bench_qsa --kinds prefill --kv bf16 --prefill-t 16384 \
              --check --json "$OUT/widen_bf16.json" ;;
    strided9) run 300 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
                -p no:cacheprovider
              for i in 1 2; do
                TAIL=12 run 150 strided_$i python3 -m profiling.bench_decode --kv fp8,bf16 --shapes B1,B8 \
                  --peers strided --quick --json "$OUT/strided_$i.json"
              done ;;
    final9) run 300 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
              -p no:cacheprovider
            TAIL=60 run 300 peers9 python3 -m profiling.bench_decode --kv fp8 --peers xqa,xqa_nopdl,fi,contiguous --quick \
              --json "$OUT/decode_peers9.json" ;;
    rerun9) TAIL=10 run 200 rerun_prefill python3 -m profiling.bench_qsa --kinds prefill --kv bf16,fp8 --prefill-t 16384 \
              --tuning ";;" --check --json "$OUT/rerun_prefill.json"
            TAIL=8 run 100 rerun_decode python3 -m profiling.bench_decode --kv fp8 --shapes B1,B8 --peers contiguous \
              --quick --json "$OUT/rerun_decode.json" ;;
    splits9) for i in 1 2; do
               TAIL=14 run 100 splits_$i python3 -m profiling.bench_decode --kv fp8 --shapes B8 --quick \
                 --peers "num_splits=12+occupancy=3,num_splits=11+occupancy=3,num_splits=16+occupancy=4,num_splits=14+occupancy=4,num_splits=8+occupancy=2,num_splits=10+occupancy=3" \
                 --json "$OUT/splits_$i.json"
             done ;;
    gate13) TAIL=30 run 200 nogate python3 -m profiling.bench_qsa --kinds decode --kv fp8,bf16 --decode-n 64,256 \
              --decode-counts 64,2051 --no-gate --json "$OUT/nogate.json"
            TAIL=30 run 200 gate python3 -m profiling.bench_qsa --kinds decode --kv fp8,bf16 --decode-n 64,256 \
              --decode-counts 64,2051 --json "$OUT/gate.json" ;;
    qsaprod) run 120 qsaprod python3 -m profiling.bench_qsa --kinds decode --decode-n 16,64,256 \
               --tuning "producers=1;producers=2;producers=1;producers=2" --json "$OUT/qsaprod.json" ;;
    # --report-api-errors no: the DSL's compiler probes driver entry points (cuGetProcAddress) and
    # those expected CUDA_ERROR_INVALID_VALUE returns would otherwise count as errors
    diag10) TAIL=30 run 200 n4slope python3 -m profiling.bench_qsa --kinds decode --kv bf16,fp8 --decode-n 4 \
              --decode-counts 64,704,1408,2051 --json "$OUT/n4slope.json"
            TAIL=20 run 200 n4l2 python3 -m profiling.bench_qsa --kinds decode --kv bf16,fp8 --decode-n 4 --decode-shared \
              --decode-counts 704,2051 --json "$OUT/n4l2.json"
            python3 -m profiling.ncu_qsa --shape decode-bf16-4 > /dev/null 2>&1
            TAIL=80 run 100 ncu_qsa_n4 ncu --cache-control none --clock-control none --kernel-name regex:qsa \
              --launch-skip 6 --launch-count 2 --section SpeedOfLight --section LaunchStats --section Occupancy \
              --section WarpStateStats --section MemoryWorkloadAnalysis python3 -m profiling.ncu_qsa --shape decode-bf16-4
            python3 -m profiling.ncu_decode --shape "llama3-8b B1 ctx1000" > /dev/null 2>&1
            TAIL=60 run 100 ncu_b1 ncu --cache-control none --clock-control none --kernel-name regex:decode \
              --launch-skip 3 --launch-count 1 --section SpeedOfLight --section LaunchStats --section WarpStateStats \
              python3 -m profiling.ncu_decode --shape "llama3-8b B1 ctx1000" ;;
    cluster10) run 420 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
                 -p no:cacheprovider
               for i in 1 2; do
                 TAIL=30 run 150 cluster_$i python3 -m profiling.bench_decode --kv fp8,bf16 --shapes B1,B8,d64 \
                   --peers global,occupancy=2,num_splits=8 --quick --json "$OUT/cluster_$i.json"
               done ;;
    final10) run 300 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
               -p no:cacheprovider
             run 150 sanitize compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
               python3 -m profiling.sanitize
             for i in 1 2; do
               TAIL=14 run 150 cluster_$i python3 -m profiling.bench_decode --kv fp8,bf16 --shapes B1,B8,d64 \
                 --peers global --quick --json "$OUT/cluster_$i.json"
             done ;;
    peers10) TAIL=60 run 300 peers10 python3 -m profiling.bench_decode --kv fp8 --peers xqa,xqa_nopdl,fi,global --quick \
               --json "$OUT/decode_peers10.json" ;;
    final11) run 300 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
               -p no:cacheprovider
             run 150 sanitize compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
               python3 -m profiling.sanitize
             TAIL=14 run 150 cluster11 python3 -m profiling.bench_decode --kv fp8,bf16 --shapes B1,B8,d64 \
               --peers global --quick --json "$OUT/cluster11.json" ;;
    peers11f) TAIL=60 run 420 peers11f python3 -m profiling.bench_decode --kv fp8 --peers xqa,xqa_nopdl,fi,sdpa \
                --json "$OUT/decode_peers11_fp8.json" --png "$OUT/decode_peers11_fp8.png" ;;
    peers11b) TAIL=60 run 500 peers11b python3 -m profiling.bench_decode --kv bf16 --peers xqa,fi,fa4,sdpa \
                --json "$OUT/decode_peers11_bf16.json" --png "$OUT/decode_peers11_bf16.png" ;;
    sanitize) run 150 sanitize compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m profiling.sanitize
              run 150 sanitize_qsa compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m profiling.sanitize_qsa ;;
    ncu) for sh in "qwen3-30b B8 ctx32000" "d256 h16/8 B32 ctx8192" "llama3-8b B1 ctx1000"; do
           python3 -m profiling.ncu_decode --shape "$sh" > /dev/null 2>&1  # compile outside the profiler
           TAIL=60 run 120 "ncu_${sh%% *}_${sh##* }" ncu --clock-control none --kernel-name regex:decode \
             --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
             --section WarpStateStats --section MemoryWorkloadAnalysis python3 -m profiling.ncu_decode --shape "$sh"
         done ;;
    dtest12) run 330 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
               -p no:cacheprovider ;;
    evict12) run 200 warm_decode python3 -m profiling.warm_variants decode \
               "evict_first=1;evict_first=0+prefetch_desc=0;evict_first=0;prefetch_desc=0"
             TAIL=40 run 300 evict12 python3 -m profiling.bench_decode --kv fp8,bf16 --quick \
               --peers "evict_first=0+prefetch_desc=0,evict_first=0,prefetch_desc=0" \
               --json "$OUT/evict12.json" ;;
    smem12) run 330 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
              -p no:cacheprovider
            for r in 1 2; do
              TAIL=12 run 150 "smem12_$r" python3 -m profiling.bench_decode --kv fp8,bf16 --quick --shapes "B8 ctx" \
                --peers "smem_merge=0,evict_first=0+prefetch_desc=0+smem_merge=0" --json "$OUT/smem12_$r.json"
            done ;;
    qevict12) run 200 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider \
                -k "l2_policy or forced_splits"
              TAIL=40 run 300 qsa_evict12 python3 -m profiling.bench_qsa --kinds decode --decode-n 1,4,16,64,256 \
                --check --tuning ";evict_first=1;" --json "$OUT/qsa_evict12.json" ;;
    final12) TAIL=8 run 100 latency12 python3 -m profiling.bench_latency --quick --json "$OUT/latency12.json"
             TAIL=14 run 150 qsa12 python3 -m profiling.bench_qsa --kinds decode --check --json "$OUT/qsa12.json" ;;
    retest12a) run 330 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
                 -p no:cacheprovider
               run 200 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider \
                 -k "l2_policy or forced_splits" ;;
    retest12b) run 150 sanitize compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                 python3 -m profiling.sanitize
               TAIL=12 run 150 smem12_retest python3 -m profiling.bench_decode --kv fp8,bf16 --quick --shapes "B8 ctx" \
                 --peers "smem_merge=0,evict_first=0+prefetch_desc=0+smem_merge=0" --json "$OUT/smem12_retest.json"
               TAIL=8 run 100 latency12_retest python3 -m profiling.bench_latency --quick --json "$OUT/latency12_retest.json" ;;
    mgroup13a) run 420 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider ;;
    mgroup13b) TAIL=30 run 240 qsa_mgroup13 python3 -m profiling.bench_qsa --kinds decode --decode-n 1,4,16 --check \
                 --tuning ";merge_group=8;;merge_group=8" --json "$OUT/qsa_mgroup13.json"
               TAIL=20 run 200 qsa_tile_evict13 python3 -m profiling.bench_qsa --kinds prefill --prefill-t 16384 \
                 --selection correlated --tuning ";evict_first=1;;evict_first=1" --json "$OUT/qsa_tile_evict13.json" ;;
    kvbar13a) run 300 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider
              run 150 sanitize_qsa compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                python3 -m profiling.sanitize_qsa ;;
    kvbar13b) TAIL=45 run 280 qsa_kvbar13 python3 -m profiling.bench_qsa --kinds decode --decode-n 1,4,16,64,256 \
                --tuning ";kv_barriers=0;;kv_barriers=0" --json "$OUT/qsa_kvbar13.json" ;;
    peers13) TAIL=30 run 280 peers13f python3 -m profiling.bench_decode --kv fp8 --peers xqa,xqa_nopdl,fi,sdpa \
               --json "$OUT/decode_peers13_fp8.json" --png "$OUT/decode_peers13_fp8.png"
             TAIL=30 run 300 peers13b python3 -m profiling.bench_decode --kv bf16 --peers xqa,fi,fa4,sdpa \
               --json "$OUT/decode_peers13_bf16.json" --png "$OUT/decode_peers13_bf16.png" ;;
    final13) run 120 pytest_qsa13 python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider \
               -k "barriers_against_the_rule or forced_splits"
             TAIL=14 run 150 qsa13 python3 -m profiling.bench_qsa --kinds decode --check --json "$OUT/qsa13.json" ;;
    lanes14) run 300 pytest_lanes python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider \
               -k "merge_lanes or forced_splits"
             TAIL=30 run 200 qsa_lanes14 python3 -m profiling.bench_qsa --kinds decode --decode-n 1,4 \
               --tuning ";merge_lanes=1;merge_lanes=2,merge_group=8;;merge_lanes=1;merge_lanes=2,merge_group=8" \
               --json "$OUT/qsa_lanes14.json" ;;
    rel14) run 200 warm14 python3 -m profiling.warm_variants qsa "pdl=1,release=1;pdl=1,release=2;pdl=1"
           run 200 pytest_rel14 python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider \
             -k "unsplit_release_chain or forced_splits"
           TAIL=40 run 250 qsa_rel14 python3 -m profiling.bench_qsa --kinds decode --decode-n 64,256 \
             --tuning ";pdl=1,release=1;pdl=1,release=2;pdl=1;;pdl=1,release=1;pdl=1,release=2;pdl=1" \
             --json "$OUT/qsa_rel14.json" ;;
    final15a) run 420 pytest_qsa15 python3 -m pytest tests/gpu/test_qsa_gpu.py tests/gpu/test_qsa_union_gpu.py -q \
                -p no:cacheprovider
              run 150 sanitize_qsa15 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                python3 -m profiling.sanitize_qsa ;;
    final15b) run 240 pytest15 python3 -m pytest tests/gpu -q -p no:cacheprovider \
                --ignore=tests/gpu/test_qsa_gpu.py --ignore=tests/gpu/test_qsa_union_gpu.py
              TAIL=40 run 330 qsa15 python3 -m profiling.bench_qsa --check --json "$OUT/qsa15.json" ;;
    lanes15) for i in 1 2; do
               TAIL=16 run 200 lanes15_$i python3 -m profiling.bench_qsa --kinds decode --decode-n 4,16 \
                 --tuning ";merge_lanes=2,merge_group=8;merge_lanes=4,merge_group=4" --json "$OUT/lanes15_$i.json"
             done ;;
    clocks15) TAIL=10 run 200 clocks15_bf16 python3 -m profiling.probe_clocks --kv bf16 --rounds 4 --json "$OUT/clocks15_bf16.json"
              TAIL=8 run 200 clocks15_fp8 python3 -m profiling.probe_clocks --kv fp8 --rounds 3 --json "$OUT/clocks15_fp8.json" ;;
    confirm15) for i in 1 2 3; do
                 nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
                 TAIL=3 run 150 prefill15_$i python3 -m profiling.bench_qsa --kinds prefill --prefill-t 16384 \
                   --selection correlated --json "$OUT/prefill15_$i.json"
               done
               nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
               TAIL=12 run 150 decode15 python3 -m profiling.bench_qsa --kinds decode --json "$OUT/decode15.json" ;;
    final14a) run 420 pytest_qsa14 python3 -m pytest tests/gpu/test_qsa_gpu.py tests/gpu/test_qsa_union_gpu.py -q \
                -p no:cacheprovider
              run 150 sanitize_qsa compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                python3 -m profiling.sanitize_qsa ;;
    final14b) TAIL=14 run 170 qsa14 python3 -m profiling.bench_qsa --kinds decode --check --json "$OUT/qsa14.json"
              TAIL=30 run 250 qsa_p4_14 python3 -m profiling.bench_qsa --kinds decode --decode-n 4,16,64 \
                --tuning ";producers=4;;producers=4" --json "$OUT/qsa_p4_14.json" ;;
    eager13) for i in 1 2; do
               TAIL=12 run 150 eager13_$i python3 -m profiling.bench_latency --eager-study --json "$OUT/eager13_$i.json"
             done ;;
    retest12) run 330 pytest_decode python3 -m pytest tests/gpu/test_decode_gpu.py tests/gpu/test_merge_gpu.py -q \
                -p no:cacheprovider
              run 200 pytest_qsa python3 -m pytest tests/gpu/test_qsa_gpu.py -q -p no:cacheprovider \
                -k "l2_policy or forced_splits"
              run 150 sanitize compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
                python3 -m profiling.sanitize
              TAIL=12 run 150 smem12_retest python3 -m profiling.bench_decode --kv fp8,bf16 --quick --shapes "B8 ctx" \
                --peers "smem_merge=0,evict_first=0+prefetch_desc=0+smem_merge=0" --json "$OUT/smem12_retest.json"
              TAIL=8 run 100 latency12_retest python3 -m profiling.bench_latency --quick --json "$OUT/latency12_retest.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
# only 8 files come back from the device machine: ship one archive
(cd "$OUT" && tar czf /tmp/gpu_results.tgz --exclude=gpu_results.tgz . && find . -mindepth 1 -delete && mv /tmp/gpu_results.tgz .)
echo "=== done $(date +%T)"
