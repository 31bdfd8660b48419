#!/usr/bin/env bash
# Install what a fresh Debian 12 machine with only rustup lacks to build and test megatrain.
# Idempotent: installs nothing that is already there.
#   --aarch64   also what tools/test_aarch64.sh needs: the aarch64 cross toolchain, Debian's
#               arm64 hwloc and udev (multiarch), qemu-user and the Rust target
set -euo pipefail
AARCH64=0
[ "${1:-}" = "--aarch64" ] && AARCH64=1

# g++: the CUDA emulator (tools/cuemu.sh) compiles CUDA kernels for the host with it.
# python3-venv: tools/setup-cuda-wheels.sh installs NVIDIA's PyPI wheels into a venv.
# Open MPI and libclang: the `mpi` feature (data parallelism; the mpi crate's bindgen needs
# libclang) and its tests under mpirun.
APT_PACKAGES=(libhwloc-dev pkg-config libudev-dev gcc g++ libc6-dev python3-venv
              libopenmpi-dev openmpi-bin libclang-dev)

if [ "$AARCH64" = 1 ]; then
  APT_PACKAGES+=(qemu-user-static gcc-aarch64-linux-gnu libc6-dev-arm64-cross binutils-aarch64-linux-gnu
                 file libhwloc-dev:arm64 libudev-dev:arm64)
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    echo "setup-deps: adding the arm64 architecture (multiarch) for the aarch64 libraries"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO dpkg --add-architecture arm64
  fi
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup-deps: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup-deps: cargo not found; install Rust with rustup (https://rustup.rs) first" >&2
  exit 1
fi
if command -v rustup >/dev/null 2>&1; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c" >/dev/null
  done
  if [ "$AARCH64" = 1 ]; then
    rustup target list --installed | grep -qx aarch64-unknown-linux-gnu \
      || rustup target add aarch64-unknown-linux-gnu >/dev/null
  fi
fi
