#!/usr/bin/env bash
# Install NVRTC, the CUDA headers and ptxas from NVIDIA's PyPI wheels into a venv (no toolkit,
# no GPU needed), then print the variables megatrain reads:
#   eval "$(tools/setup-cuda-wheels.sh)"
# The venv lives in ${MEGATRAIN_CUDA_VENV:-$HOME/.cache/megatrain/cuda-wheels}.
set -euo pipefail
venv="${MEGATRAIN_CUDA_VENV:-$HOME/.cache/megatrain/cuda-wheels}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
fi
# Pinned: the versions the kernels were last checked with.
"$venv/bin/pip" install --quiet --disable-pip-version-check \
    nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86 >&2
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
lib="$site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
inc="$site/nvidia/cuda_runtime/include"
ptxas="$site/nvidia/cuda_nvcc/bin/ptxas"
for f in "$lib" "$inc/cuda_bf16.h" "$ptxas"; do
    [ -e "$f" ] || { echo "error: $f missing after installing the wheels" >&2; exit 1; }
done
echo "export MEGATRAIN_NVRTC_LIB='$lib'"
echo "export MEGATRAIN_CUDA_INCLUDE='$inc'"
echo "export MEGATRAIN_PTXAS='$ptxas'"
