#!/usr/bin/env bash
# Install NVRTC, the CUDA headers and ptxas from NVIDIA's PyPI wheels (no toolkit, no GPU needed),
# then print the variables megatrain reads:
#   eval "$(tools/setup-cuda-wheels.sh)"
# Into a venv at ${MEGATRAIN_CUDA_VENV:-$HOME/.cache/megatrain/cuda-wheels}, or, where Python has no
# venv module (Debian without python3-venv), into a plain `pip install --target` directory there.
# With --cublas it also installs cuBLAS (nvidia-cublas-cu12, ~600 MB: for a GPU machine without a
# toolkit; the CUDA emulator brings its own) and prints MEGATRAIN_CUBLAS_LIB.
set -euo pipefail
dir="${MEGATRAIN_CUDA_VENV:-$HOME/.cache/megatrain/cuda-wheels}"
cublas=""
[ "${1:-}" = "--cublas" ] && cublas="nvidia-cublas-cu12==12.9.1.4"
# Pinned: the versions the kernels were last checked with.
# nvidia-cuda-cccl-cu12 holds the libcu++ headers cuda_bf16.h needs when the CUDA emulator
# (tools/cuemu.sh) compiles kernels for the host.
wheels=(nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86
        nvidia-cuda-cccl-cu12==12.9.27 $cublas)
if [ -x "$dir/bin/python" ] || python3 -m venv "$dir" >&2 2>/dev/null; then
    "$dir/bin/pip" install --quiet --disable-pip-version-check "${wheels[@]}" >&2
    site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
else
    echo "note: no python3 venv module; installing the wheels with pip --target" >&2
    python3 -m pip install --quiet --disable-pip-version-check --target "$dir/site" "${wheels[@]}" >&2
    site="$dir/site"
fi
lib="$site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
inc="$site/nvidia/cuda_runtime/include"
ptxas="$site/nvidia/cuda_nvcc/bin/ptxas"
host_inc="$site/nvidia/cuda_nvcc/include:$site/nvidia/cuda_cccl/include"
for f in "$lib" "$inc/cuda_bf16.h" "$ptxas" "$site/nvidia/cuda_nvcc/include/crt/host_defines.h" \
         "$site/nvidia/cuda_cccl/include/nv/target"; do
    [ -e "$f" ] || { echo "error: $f missing after installing the wheels" >&2; exit 1; }
done
echo "export MEGATRAIN_NVRTC_LIB='$lib'"
echo "export MEGATRAIN_CUDA_INCLUDE='$inc'"
echo "export MEGATRAIN_PTXAS='$ptxas'"
echo "export MEGATRAIN_CUDA_HOST_INCLUDE='$host_inc'"
if [ -n "$cublas" ]; then
    cublas_lib="$site/nvidia/cublas/lib/libcublas.so.12"
    [ -e "$cublas_lib" ] || { echo "error: $cublas_lib missing after installing the wheel" >&2; exit 1; }
    echo "export MEGATRAIN_CUBLAS_LIB='$cublas_lib'"
fi
