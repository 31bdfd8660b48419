#!/usr/bin/env bash
# Run a command with cuemu, the CUDA emulator, in place of the NVIDIA driver, NVRTC and cuBLAS:
#   tools/cuemu.sh target/debug/megatrain selftest --device cuda
# Builds the emulator if needed (cargo, release profile), installs the CUDA wheels it compiles
# kernels with (tools/setup-cuda-wheels.sh), then runs CMD with libcuda.so.1, libcublas.so.12 and
# libnvrtc.so.12 resolved to it. Settings (CUEMU_DEVICE, CUEMU_MEMORY, CUEMU_DRIVER,
# CUEMU_SCHEDULES, CUEMU_DELAYS, CUEMU_SEED, CUEMU_REPORT, CUEMU_FAIL, …) are described in
# tools/cuemu/README.md. With CUEMU_NO_CUBLAS=1 the cuBLAS stand-in is left out (a machine
# without cuBLAS).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ "$#" -gt 0 ] || { echo "usage: tools/cuemu.sh CMD [ARGS...]" >&2; exit 2; }

# The wheels' NVRTC and headers: from the environment when tools/setup-cuda-wheels.sh was already
# evaluated (the test suite does), else installed now. A nested call keeps the real NVRTC.
if [ -z "${CUEMU_REAL_NVRTC:-}" ]; then
  if [ -z "${MEGATRAIN_NVRTC_LIB:-}" ] || [ ! -f "${MEGATRAIN_NVRTC_LIB}" ] \
     || [ -z "${MEGATRAIN_CUDA_HOST_INCLUDE:-}" ]; then
    eval "$(bash "$root/tools/setup-cuda-wheels.sh")"
  fi
  export CUEMU_REAL_NVRTC="$MEGATRAIN_NVRTC_LIB"
  export CUEMU_INCLUDE="$MEGATRAIN_CUDA_INCLUDE:$MEGATRAIN_CUDA_HOST_INCLUDE"
fi
target="${CARGO_TARGET_DIR:-$root/target}"
if [ -z "${CUEMU_SKIP_BUILD:-}" ]; then
  (cd "$root" && cargo build --quiet --release -p cuemu)
fi
lib="$target/release/libcuemu.so"
[ -f "$lib" ] || { echo "error: $lib missing (cargo build --release -p cuemu)" >&2; exit 1; }

# A directory of the names the programs ask the loader for, all pointing at the emulator.
stage="$target/cuemu/${CUEMU_NO_CUBLAS:+no-cublas-}lib"
mkdir -p "$stage"
names=(libcuda.so libcuda.so.1 libnvrtc.so libnvrtc.so.12)
[ -n "${CUEMU_NO_CUBLAS:-}" ] || names+=(libcublas.so libcublas.so.12)
# Links are only ever created, never replaced while another run may be loading them.
for n in "${names[@]}"; do
  [ "$(readlink "$stage/$n" 2>/dev/null)" = "$lib" ] || ln -sfn "$lib" "$stage/$n"
done

export CUEMU_SIMT="$root/tools/cuemu/simt"
export MEGATRAIN_NVRTC_LIB="$stage/libnvrtc.so.12"
export LD_LIBRARY_PATH="$stage${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
