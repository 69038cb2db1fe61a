# The lab scripts' environment, sourced from the repository root by profiling/run.sh and
# profiling/sanitize_cases.sh: the offline install when .wheelhouse/part* exist (profiling/offline/),
# else the checkout on PYTHONPATH; the kernel disk cache, the output folder and the interpreter.
# Settings: CUTE_KERNELS_CACHE_DIR (/tmp/ck_cache), OUT (profiling/out), PYTHON (python3).
if ls -d .wheelhouse/part* > /dev/null 2>&1; then
  # shellcheck source=offline/install.sh
  source profiling/offline/install.sh || return 2
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
export CUTE_KERNELS_CACHE_DIR=${CUTE_KERNELS_CACHE_DIR:-/tmp/ck_cache}
OUT=${OUT:-profiling/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
