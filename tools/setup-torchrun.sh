#!/usr/bin/env bash
# Install PyTorch (what provides `torchrun`, the launcher tests/dist.rs and
# tools/gpu_dp_check.sh start CUDA ranks with, as users do) into a venv at
# ${MEGATRAIN_TORCH_VENV:-$HOME/.cache/megatrain/torch-venv}, then print its torchrun's path.
# Idempotent; needs the package registry the first time (about 2.8 GB of wheels: PyTorch and
# the NVIDIA libraries it loads at import, although torchrun itself uses none of them).
set -euo pipefail
own=1; [ -n "${MEGATRAIN_TORCH_VENV:-}" ] && own=0
dir="${MEGATRAIN_TORCH_VENV:-$HOME/.cache/megatrain/torch-venv}"
# Pinned: the version whose store protocol (src/dist/store.rs) was last checked.
py="$(bash "$(dirname "$0")/py-venv.sh" "$dir" "$own" torch.distributed.run "torch==2.15.0")"
echo "$(dirname "$py")/torchrun"
