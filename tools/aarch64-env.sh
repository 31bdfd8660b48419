# Sourced (not run): the environment that cross-builds megatrain for aarch64-unknown-linux-gnu with
# Debian's cross toolchain and its arm64 hwloc and udev (multiarch; `tools/setup-deps.sh --aarch64`
# installs them). tools/test_aarch64.sh and tools/build_wheels.sh use it.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=qemu-aarch64-static
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
# hwloc and udev from Debian's arm64 packages, not the host's; named for the target, so that an
# x86-64 build in the same environment keeps the host's.
export PKG_CONFIG_ALLOW_CROSS_aarch64_unknown_linux_gnu=1
export PKG_CONFIG_LIBDIR_aarch64_unknown_linux_gnu=/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig
