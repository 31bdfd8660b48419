#!/usr/bin/env bash
# Install NVRTC, the CUDA headers and ptxas of one CUDA release from NVIDIA's PyPI wheels (no
# toolkit, no GPU needed), then print the variables megatrain and the CUDA emulator read:
#   eval "$(tools/setup-cuda-wheels.sh)"              # CUDA 12.9 (what the emulator runs by default)
#   eval "$(tools/setup-cuda-wheels.sh --cuda 13)"    # CUDA 13.0 (driver R580, the 2026 servers)
# Into a venv at ${MEGATRAIN_WHEELS_DIR:-$HOME/.cache/megatrain/cuda<MAJOR>-wheels} (where megatrain
# also looks for them by itself), or, where Python has no venv module (Debian without
# python3-venv), into a plain `pip install --target` directory there.
# With --cublas it also installs cuBLAS (~600 MB: for a GPU machine with neither a toolkit nor
# PyTorch's wheels; the CUDA emulator brings its own) and prints MEGATRAIN_CUBLAS_LIB.
# Needs the package registry: on a GPU node without network, point MEGATRAIN_CUDA_VENV at a venv
# that already has the wheels (PyTorch's does) instead.
set -euo pipefail
major=12
cublas=""
while [ "$#" -gt 0 ]; do
    case "$1" in
        --cuda) major="${2:?--cuda needs 12 or 13}"; shift 2 ;;
        --cublas) cublas=1; shift ;;
        *) echo "usage: tools/setup-cuda-wheels.sh [--cuda 12|13] [--cublas]" >&2; exit 2 ;;
    esac
done
# Pinned: the versions the kernels were last checked with. The cccl headers (libcu++) are what
# cuda_bf16.h needs when the CUDA emulator (tools/cuemu.sh) compiles kernels for the host.
case "$major" in
    12)
        wheels=(nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79
                nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-cccl-cu12==12.9.27)
        [ -z "$cublas" ] || wheels+=(nvidia-cublas-cu12==12.9.1.4)
        ;;
    13)
        # CUDA 13 splits the compiler's headers (crt/) into their own wheel and keeps every
        # library under nvidia/cu13/.
        wheels=(nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
                nvidia-cuda-nvcc==13.0.88 nvidia-cuda-cccl==13.0.85)
        [ -z "$cublas" ] || wheels+=(nvidia-cublas==13.1.0.3)
        ;;
    *) echo "error: --cuda $major: megatrain runs on CUDA 12 and 13" >&2; exit 2 ;;
esac
dir="${MEGATRAIN_WHEELS_DIR:-$HOME/.cache/megatrain/cuda${major}-wheels}"
# Our own cache venv left without its pip (what `python3 -m venv` leaves where ensurepip is
# missing) is removed and made again; a directory given by MEGATRAIN_WHEELS_DIR is never deleted.
if [ -z "${MEGATRAIN_WHEELS_DIR:-}" ] && [ ! -x "$dir/bin/pip" ] && [ -f "$dir/pyvenv.cfg" ]; then
    rm -rf "$dir"
fi
if [ -x "$dir/bin/pip" ] || python3 -m venv "$dir" >&2 2>/dev/null; then
    "$dir/bin/pip" install --quiet --disable-pip-version-check "${wheels[@]}" >&2
    site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
else
    echo "note: no python3 venv module; installing the wheels with pip --target" >&2
    python3 -m pip install --quiet --disable-pip-version-check --target "$dir/site" "${wheels[@]}" >&2
    site="$dir/site"
fi
if [ "$major" = 13 ]; then
    root="$site/nvidia/cu13"
    lib="$root/lib/libnvrtc.so.13"
    inc="$root/include"
    ptxas="$root/bin/ptxas"
    host_inc="$root/include:$root/include/cccl"
    cublas_lib="$root/lib/libcublas.so.13"
    checks=("$root/include/crt/host_defines.h" "$root/include/cccl/nv/target")
else
    lib="$site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
    inc="$site/nvidia/cuda_runtime/include"
    ptxas="$site/nvidia/cuda_nvcc/bin/ptxas"
    host_inc="$site/nvidia/cuda_nvcc/include:$site/nvidia/cuda_cccl/include"
    cublas_lib="$site/nvidia/cublas/lib/libcublas.so.12"
    checks=("$site/nvidia/cuda_nvcc/include/crt/host_defines.h" "$site/nvidia/cuda_cccl/include/nv/target")
fi
for f in "$lib" "$inc/cuda_bf16.h" "$ptxas" "${checks[@]}"; do
    [ -e "$f" ] || { echo "error: $f missing after installing the wheels" >&2; exit 1; }
done
echo "export MEGATRAIN_NVRTC_LIB='$lib'"
echo "export MEGATRAIN_CUDA_INCLUDE='$inc'"
echo "export MEGATRAIN_PTXAS='$ptxas'"
echo "export MEGATRAIN_CUDA_HOST_INCLUDE='$host_inc'"
if [ -n "$cublas" ]; then
    [ -e "$cublas_lib" ] || { echo "error: $cublas_lib missing after installing the wheel" >&2; exit 1; }
    echo "export MEGATRAIN_CUBLAS_LIB='$cublas_lib'"
fi
