#!/usr/bin/env bash
# Build what a GPU server needs to run megatrain's CUDA path, with no toolkit, compiler or
# network there: the release binary with the `cuda` feature, stripped, and the shared libraries
# it links that a GPU image may lack (libhwloc, libudev) beside it in lib/:
#   tools/build_gpu_bundle.sh [OUT_DIR]        # default dist/megatrain-cuda
#   tools/build_gpu_bundle.sh --mpi [OUT_DIR]  # default dist/megatrain-cuda-mpi: with feature mpi
#                                              # too (data parallel; tools/gpu_dp_check.sh), which
#                                              # links the server's libmpi.so.40 (Open MPI 4 or 5)
# Copy OUT_DIR (under 40 MiB) to the server with the repository (or just tools/gpu_check.sh and
# tests/golden) and run `tools/gpu_check.sh OUT`, which finds it at dist/megatrain-cuda or through
# MEGATRAIN_BIN=OUT_DIR/megatrain. CUDA itself (driver, NVRTC, cuBLAS) is the server's: the
# binary finds CUDA 12 or 13 in the toolkit, on the loader's path or in NVIDIA's pip wheels
# (PyTorch's venv has them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
features=cuda name=megatrain-cuda
[ "${1:-}" = --mpi ] && { features=cuda,mpi name=megatrain-cuda-mpi; shift; }
out="${1:-$root/dist/$name}"
cd "$root"
bash tools/setup-deps.sh >&2
echo "== cargo build --release --features $features" >&2
cargo build --release --features "$features" --bin megatrain >&2
target="${CARGO_TARGET_DIR:-$root/target}"
rm -rf "$out"
mkdir -p "$out/lib"
cp "$target/release/megatrain" "$out/megatrain"
strip --strip-all "$out/megatrain"
# The libraries the binary needs beyond glibc and libgcc, resolved as the loader resolves them
# here, copied under their sonames.
for so in libhwloc.so.15 libudev.so.1; do
  path="$(ldd "$target/release/megatrain" | awk -v s="$so" '$1 == s { print $3 }')"
  [ -n "$path" ] && [ -f "$path" ] || { echo "error: the binary does not resolve $so here" >&2; exit 1; }
  cp -L "$path" "$out/lib/$so"
done
{
  echo "commit $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m) with $(rustc --version), features $features"
  need="$(objdump -T "$out/megatrain" "$out"/lib/*.so* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)"
  echo "needs ${need:-an unknown glibc} or newer (built against glibc $(ldd --version | head -1 | awk '{print $NF}'))"
} > "$out/VERSION"
bytes="$(du -sb "$out" | awk '{print $1}')"
limit=$((40 << 20))
echo "bundle: $out, $(du -sh "$out" | awk '{print $1}') ($bytes bytes): megatrain $(du -h "$out/megatrain" | awk '{print $1}'), lib/ $(du -sh "$out/lib" | awk '{print $1}')" >&2
[ "$bytes" -le "$limit" ] || { echo "error: the bundle is over 40 MiB" >&2; exit 1; }
echo "$out"
