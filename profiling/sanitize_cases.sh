#!/usr/bin/env bash
# compute-sanitizer over a driver's named cases, one process per case, so that a failing case leaves
# the others' verdicts standing (docs/design/testing.md#sanitizer). From the repository root on a GPU
# host:
#
#   bash profiling/sanitize_cases.sh TOOL MODULE [CASE...]
#   e.g. bash profiling/sanitize_cases.sh synccheck profiling.sanitize_decode
#
# MODULE takes --list and --case NAME[,NAME...] (profiling.sanitize_decode does); CASE... defaults to
# every case it lists. The cases first run once without a sanitizer (their variants compile into the
# disk cache; log $OUT/plain_DRIVER.log, DRIVER the module's last name), then each case as
#
#   CUDA_LAUNCH_BLOCKING=1 compute-sanitizer --tool TOOL --report-api-errors no --error-exitcode 9 \
#     --print-limit 100 [--racecheck-report hazard] python3 -m MODULE --case NAME
#
# with its log in $OUT/TOOL_DRIVER_NAME.log, printing one line:
#
#   case NAME rc RC errors N last: <the last "case NAME: ..." line the driver printed>
#
# (errors: the count the tool's summary reports, "none" when it printed none). Exit status 0 when
# the plain run and every case finished with rc 0 and 0 errors, 1 otherwise. Settings: those of
# profiling/env.sh, COMPUTE_SANITIZER (compute-sanitizer), CASE_TIMEOUT (seconds per run, 600),
# DRIVER_ARGS (more arguments for every run of the driver, e.g. "--device cpu").
set -o pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash profiling/sanitize_cases.sh TOOL MODULE [CASE...]" >&2
  exit 2
fi
tool=$1 module=$2
shift 2
cd "$(dirname "$0")/.."
# shellcheck source=env.sh
source profiling/env.sh || exit 2
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
extra=()
[ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
if [ $# -gt 0 ]; then
  cases=("$@")
else
  listed=$("$PY" -m "$module" --list) || { echo "$module --list failed" >&2; exit 2; }
  mapfile -t cases <<< "$listed"
fi
[ ${#cases[@]} -gt 0 ] || { echo "$module lists no case" >&2; exit 2; }
driver=${module##*.}
read -r -a args <<< "${DRIVER_ARGS:-}"
timeout "${CASE_TIMEOUT:-600}" "$PY" -m "$module" --case "$(IFS=,; echo "${cases[*]}")" "${args[@]}" \
  > "$OUT/plain_$driver.log" 2>&1
rc=$?
echo "plain run rc $rc last: $(grep -a "^case " "$OUT/plain_$driver.log" | tail -n 1)"
bad=0
[ "$rc" = 0 ] || bad=1
for name in "${cases[@]}"; do
  log="$OUT/${tool}_${driver}_${name}.log"
  CUDA_LAUNCH_BLOCKING=1 timeout "${CASE_TIMEOUT:-600}" "$SAN" --tool "$tool" --report-api-errors no \
    --error-exitcode 9 --print-limit 100 "${extra[@]}" "$PY" -m "$module" --case "$name" "${args[@]}" > "$log" 2>&1
  rc=$?
  errors=$("$PY" -m profiling.sanitizer_reports "$log")
  last=$(grep -a "^case " "$log" | tail -n 1)
  echo "case $name rc $rc errors $errors last: ${last:-(none)}"
  [ "$rc" = 0 ] && [ "$errors" = 0 ] || bad=1
done
exit $bad
