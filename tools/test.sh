#!/usr/bin/env bash
# The test suite: formatting, lints (default and `cuda` + `mpi` features, and the CUDA emulator),
# every test with feature `mpi` (data parallelism through the CLI under mpirun: tests/dist.rs), every
# CUDA kernel compiled by NVRTC 12.9 and 13.0 (installed from PyPI wheels; no GPU or toolkit
# needed), the CUDA path run end to end under the CUDA emulator (tools/cuemu.sh) presenting CUDA 12
# and CUDA 13, tools/gpu_check.sh --emulated among it, data-parallel CUDA ranks under the emulator
# (tools/gpu_dp_check.sh --emulated) under mpirun and torchrun (PyTorch's, installed from PyPI by
# tools/setup-torchrun.sh), the x86_64 pip wheel built, installed into
# a fresh venv and run (tools/build_wheels.sh, tools/test_wheel.sh), and the aarch64 build linted
# and tested under qemu-user (tools/test_aarch64.sh).
# This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-deps.sh

echo "== $(date +%T) cargo fmt --check"
cargo fmt --all -- --check
echo "== $(date +%T) cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --quiet -- -D warnings
echo "== $(date +%T) cargo clippy --all-targets --features cuda,mpi -- -D warnings (no CUDA toolkit needed)"
cargo clippy --all-targets --features cuda,mpi --quiet -- -D warnings
echo "== $(date +%T) cargo clippy -p cuemu --all-targets -- -D warnings (the CUDA emulator)"
cargo clippy -p cuemu --all-targets --quiet -- -D warnings
# With feature mpi, one build: every test, and data parallelism through the CLI under mpirun
# with 2 and 3 ranks (tests/dist.rs, Open MPI). A process that no launcher started is one rank,
# as in a build without MPI (whose refusal of several ranks the aarch64 build's tests check).
echo "== $(date +%T) cargo test --features mpi"
cargo test --all-targets --features mpi
cargo test -p cuemu
echo "== $(date +%T) the CUDA feature's unit tests (the kernel cache)"
cargo test --features cuda --lib device::cuda
echo "== $(date +%T) CUDA kernels through NVRTC 13.0 for sm_80 and sm_90 (NVRTC + headers from PyPI wheels, no GPU)"
(eval "$(bash tools/setup-cuda-wheels.sh --cuda 13)"
 MEGATRAIN_REQUIRE_NVRTC=1 cargo test --features cuda --test kernels -- --nocapture)
echo "== $(date +%T) CUDA kernels through NVRTC 12.9 for sm_80 and sm_90"
eval "$(bash tools/setup-cuda-wheels.sh)"
MEGATRAIN_REQUIRE_NVRTC=1 cargo test --features cuda --test kernels -- --nocapture
echo "== $(date +%T) the CUDA path under the CUDA emulator: selftest, training vs PyTorch, the emulator's teeth"
# Every launch of the self-test runs under three thread schedules and shared-memory poisons; the
# emulator presents CUDA 12 here, and CUDA 13 (sonames .so.13, memory pools) in gpu_check's test.
CUEMU_SCHEDULES=3 cargo test --features cuda --test cuda_gpu
cargo test --features cuda --test train_golden --test cuemu --test generate
echo "== $(date +%T) the training goldens on the CUDA device with the emulator presenting CUDA 13"
CUEMU_CUDA=13 cargo test --features cuda --test train_golden cuda::
echo "== $(date +%T) the pip wheel (x86_64): maturin, hwloc and udev bundled by auditwheel (manylinux_2_34), installed into a fresh venv, demo and probe"
# The dev profile reuses the binary the CUDA tests above built (same features): the packaging is
# the release wheel's, the binary the dev profile's (opt-level 1).
bash tools/build_wheels.sh --arch x86_64 --profile dev --out target/wheels-ci
bash tools/test_wheel.sh target/wheels-ci/megatrain-*-manylinux_2_34_x86_64.whl
echo "== $(date +%T) CUDA ranks: data parallel with every rank under the CUDA emulator, under mpirun and torchrun (features cuda + mpi)"
cargo test --features cuda,mpi --test dist cuda_ranks
echo "== $(date +%T) aarch64 (Grace): cross-built, linted, and run under qemu-user (tools/test_aarch64.sh)"
bash tools/test_aarch64.sh
echo "== $(date +%T) done"
