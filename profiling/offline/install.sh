# Installing without internet, step 2 (on the GPU host): source from the repository root,
#
#   source profiling/offline/install.sh
#
# after copying there the .wheelhouse/partN folders that profiling/offline/make_wheelhouse.sh made
# (in one transfer or several: source this after each). It stages the parts it finds, waits until
# every file of the manifest is there, checks their sha256, installs them into SITE (a folder of
# its own: the host's torch and triton stay as they are), and puts the repository and SITE on
# PYTHONPATH. Sourcing it again once installed only sets PYTHONPATH. Its status is 0 once ready.
#
# Settings: WHEELHOUSE (.wheelhouse), STAGE (/tmp/ck-wheelhouse), SITE (/tmp/ck-site).
_ck_wh=${WHEELHOUSE:-$PWD/.wheelhouse}
_ck_stage=${STAGE:-/tmp/ck-wheelhouse}
_ck_site=${SITE:-/tmp/ck-site}
mkdir -p "$_ck_stage" "$_ck_site"
for _ck_part in "$_ck_wh"/part*/*; do
  [ -f "$_ck_part" ] && [ ! -e "$_ck_stage/${_ck_part##*/}" ] && cp "$_ck_part" "$_ck_stage/"
done

_ck_install() {
  local manifest="$_ck_stage/MANIFEST.sha256" missing=() sum path name
  [ -f "$manifest" ] || { echo "offline install: no wheelhouse part found under $_ck_wh"; return 1; }
  while read -r sum path; do
    [ "$sum" = "#" ] && continue
    [ -f "$_ck_stage/${path##*/}" ] || missing+=("$path")
  done < "$manifest"
  if [ ${#missing[@]} -gt 0 ]; then
    echo "offline install: waiting for $(printf '%s\n' "${missing[@]%%/*}" | sort -u | tr '\n' ' ')(${#missing[@]} files)"
    return 1
  fi
  (cd "$_ck_stage" && grep -v '^#' MANIFEST.sha256 | sed 's#  part[0-9]*/#  #' | sha256sum --quiet -c -) \
    || { echo "offline install: checksum mismatch, copy the parts again"; return 1; }
  # the wheels first: pip --target --upgrade replaces a top-level folder that is already there
  # (the DSL's library wheel and its base wheel share nvidia_cutlass_dsl/)
  if ls "$_ck_stage"/*.whl >/dev/null 2>&1; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$_ck_site" "$_ck_stage"/*.whl || return 1
  fi
  # then the wheels too large for one part: unpacked, packed as xz, cut in pieces
  for name in $(ls "$_ck_stage" | sed -n 's/\.tar\.xz\.piece00$//p'); do
    cat "$_ck_stage/$name".tar.xz.piece* | xz -d -T0 | tar -xf - -C "$_ck_site" || return 1
  done
  touch "$_ck_site/.installed"
}

_ck_done() {  # leaves nothing behind but PYTHONPATH; the status of `source` says whether it is ready
  local status=$1
  unset -f _ck_install _ck_done
  unset _ck_wh _ck_stage _ck_site _ck_part _ck_pth
  return "$status"
}
if [ -e "$_ck_site/.installed" ] || _ck_install; then
  # a --target install runs no .pth file: the DSL's adds its dsl_packages folder to sys.path
  _ck_pth=""
  [ -d "$_ck_site/nvidia_cutlass_dsl/dsl_packages" ] && _ck_pth="$_ck_site/nvidia_cutlass_dsl/dsl_packages"
  export PYTHONPATH="$PWD:$_ck_site${_ck_pth:+:$_ck_pth}${PYTHONPATH:+:$PYTHONPATH}"
  echo "offline install: ready ($_ck_site)"
  _ck_done 0
else
  _ck_done 1
fi
