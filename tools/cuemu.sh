#!/usr/bin/env bash
# Run a command with cuemu, the CUDA emulator, in place of the NVIDIA driver, NVRTC and cuBLAS:
#   tools/cuemu.sh target/debug/megatrain selftest --device cuda
#   CUEMU_CUDA=13 tools/cuemu.sh target/debug/megatrain selftest --device cuda
# Builds the emulator if needed (cargo, release profile), installs the CUDA wheels it compiles
# kernels with (tools/setup-cuda-wheels.sh, of CUDA 12.9 or 13.0), then runs CMD with
# libcuda.so.1, libcublas.so.12|13, libnvrtc.so.12|13 and libnccl.so.2 resolved to it. Settings (CUEMU_CUDA,
# CUEMU_DEVICE, CUEMU_MEMORY, CUEMU_DRIVER, CUEMU_MEMORY_POOLS,
# CUEMU_SCHEDULES, CUEMU_DELAYS, CUEMU_SEED, CUEMU_REPORT, CUEMU_FAIL, …) are described in
# tools/cuemu/README.md. With CUEMU_NO_CUBLAS=1 the cuBLAS stand-in is left out (a machine
# without cuBLAS).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ "$#" -gt 0 ] || { echo "usage: tools/cuemu.sh CMD [ARGS...]" >&2; exit 2; }

# CUEMU_CUDA=13 presents CUDA 13 (sonames .so.13 only, driver 13.0, cuBLAS 13.1), else CUDA 12.
major="${CUEMU_CUDA:-12}"
case "$major" in 12|13) ;; *) echo "error: CUEMU_CUDA=$major: 12 or 13" >&2; exit 2 ;; esac
export CUEMU_CUDA="$major"

# The wheels' NVRTC and headers of that release: from the environment when
# tools/setup-cuda-wheels.sh was already evaluated for it (the test suite does), else installed
# now. A nested call keeps the real NVRTC.
if [ -z "${CUEMU_REAL_NVRTC:-}" ]; then
  case "${MEGATRAIN_NVRTC_LIB:-}" in
    *.so."$major") [ -f "$MEGATRAIN_NVRTC_LIB" ] && [ -n "${MEGATRAIN_CUDA_HOST_INCLUDE:-}" ] \
                   || eval "$(bash "$root/tools/setup-cuda-wheels.sh" --cuda "$major")" ;;
    *) eval "$(bash "$root/tools/setup-cuda-wheels.sh" --cuda "$major")" ;;
  esac
  export CUEMU_REAL_NVRTC="$MEGATRAIN_NVRTC_LIB"
  export CUEMU_INCLUDE="$MEGATRAIN_CUDA_INCLUDE:$MEGATRAIN_CUDA_HOST_INCLUDE"
fi
target="${CARGO_TARGET_DIR:-$root/target}"
if [ -z "${CUEMU_SKIP_BUILD:-}" ]; then
  (cd "$root" && cargo build --quiet --release -p cuemu)
fi
lib="$target/release/libcuemu.so"
[ -f "$lib" ] || { echo "error: $lib missing (cargo build --release -p cuemu)" >&2; exit 1; }

# A directory of the names the programs ask the loader for, all pointing at the emulator: what
# a driver plus the toolkit's (CUDA 12) or the cu13 wheels' (CUDA 13, versioned names only)
# libraries give.
stage="$target/cuemu/cuda$major${CUEMU_NO_CUBLAS:+-no-cublas}/lib"
mkdir -p "$stage"
if [ "$major" = 13 ]; then
  names=(libcuda.so.1 libnvrtc.so.13 libnccl.so.2)
  [ -n "${CUEMU_NO_CUBLAS:-}" ] || names+=(libcublas.so.13)
else
  names=(libcuda.so libcuda.so.1 libnvrtc.so libnvrtc.so.12 libnccl.so.2)
  [ -n "${CUEMU_NO_CUBLAS:-}" ] || names+=(libcublas.so libcublas.so.12)
fi
# Links are only ever created, never replaced while another run may be loading them.
for n in "${names[@]}"; do
  [ "$(readlink "$stage/$n" 2>/dev/null)" = "$lib" ] || ln -sfn "$lib" "$stage/$n"
done

export CUEMU_SIMT="$root/tools/cuemu/simt"
# megatrain finds NVRTC, cuBLAS and NCCL the way it does on a GPU server: on the loader's path (the
# stage), with the headers of their release named, and nothing named explicitly.
unset MEGATRAIN_NVRTC_LIB MEGATRAIN_CUBLAS_LIB MEGATRAIN_NCCL_LIB
export LD_LIBRARY_PATH="$stage${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
