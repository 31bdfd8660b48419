#!/usr/bin/env bash
# Grace (aarch64) for real: cross-build megatrain for aarch64-unknown-linux-gnu in release and run
# its tests and a short demo under qemu-user, so the NEON paths (AdamW, the moment codecs, the
# exponential) and everything else on the CPU side execute as aarch64 instructions.
#
#   tools/test_aarch64.sh            build, lint, test, demo; print the release binary's size and glibc
#
# What runs (tools/test.sh calls this, so CI runs it):
#   - every unit test of the library (src/**), including the NEON-vs-scalar bit-identity tests of
#     the AdamW pool (every moment format), the codecs and the exponential;
#   - the integration tests named in TESTS below: AdamW/int8 goldens and the pool, the moment
#     states, the model and training goldens against PyTorch, checkpoints (round trip, resume bit
#     for bit, kill -9 during writes), the HF safetensors reader/exporter, the document files;
#   - `megatrain train --demo` for DEMO_STEPS steps of 128 tokens (qemu computes in soft float:
#     ~20 tokens/s on the demo model), whose losses are compared with the same run on this
#     (x86-64) machine.
# The build goes through clippy-driver with -D warnings, so the aarch64-only code is linted too.
#
# What qemu-user cannot give, and how the code meets it (no test is skipped for it):
#   - NUMA memory policy (mbind, get_mempolicy: ENOSYS): treated as a kernel without NUMA,
#     one node 0 holding every page (host::region), as on a CONFIG_NUMA=n kernel;
#   - io_uring (io_uring_setup: ENOSYS): the spill I/O falls back to its threads of
#     pread/pwrite, as on a kernel without io_uring;
#   - starting another aarch64 program (the chat-template renderer re-executes megatrain): the
#     script registers qemu with binfmt_misc (root, as Debian's qemu-user-static does through
#     systemd); where it cannot, the three tests that render chat templates are left out, named.
# Left out for CI time (qemu runs this code ~20x slower), by name; they run on x86-64 and test
# no aarch64-specific code:
#   unit tests  plan::tests (the planner's arithmetic), selftest::tests (the self-test harness on
#               two CPU devices), store::planes::tests::every_fp32_pattern_round_trips (all 2^32
#               patterns of the scalar element functions; the NEON codecs' planes are tested
#               against them on random tiles);
#   integration fuzz, memory, reliability, reliability_inputs, bench_cli, engine, generate,
#               prepare_tables, tensorboard, placement, probe, and the CUDA ones (cuda_gpu, cuemu,
#               kernels).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
DEMO_STEPS=${DEMO_STEPS:-4}
TESTS=(adam_pool adamw_golden adam8bit_golden adam_state model_golden train_golden prepare train hf_io)

bash tools/setup-deps.sh --aarch64

# shellcheck source=tools/aarch64-env.sh
source tools/aarch64-env.sh
# The workspace's crates through clippy-driver: lints and code in one build. The flags are the
# same on every call, so the dependencies are built once.
RUSTC_WORKSPACE_WRAPPER=$(rustup which clippy-driver)
export RUSTC_WORKSPACE_WRAPPER
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-D warnings"
# No debug info: a third of the build's time and disk (the binary below is what ships).
export CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=debuginfo

test_args=()
for t in "${TESTS[@]}"; do test_args+=(--test "$t"); done

stage() { echo "-- $(date +%T) aarch64: $*"; }

# binfmt_misc: the kernel starts aarch64 programs through qemu (needed where megatrain starts
# itself). Registered once per boot; the F flag keeps qemu open for every mount namespace.
register_qemu() {
  local bf=/proc/sys/fs/binfmt_misc
  [ -e "$bf/qemu-aarch64" ] && return 0
  [ "$(id -u)" -eq 0 ] || return 1
  [ -e "$bf/register" ] || mount -t binfmt_misc binfmt_misc "$bf" 2>/dev/null || return 1
  echo ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F' \
    >"$bf/register" 2>/dev/null
}
no_reexec=()
if ! register_qemu; then
  echo "NOTE: qemu is not registered with binfmt_misc (needs root and binfmt_misc): left out, as they"
  echo "      need megatrain to start itself: sft_chat_one_document_per_row,"
  echo "      sft_chat_packed_with_grad_accumulation, sft_mixtral_aux_loss_leaves_padding_out"
  no_reexec=(--skip sft_chat_ --skip sft_mixtral_aux_loss_leaves_padding_out)
fi

stage "build (release, clippy -D warnings)"
cargo build --release --target "$TARGET" -p megatrain --bin megatrain --quiet
cargo test --release --target "$TARGET" -p megatrain --lib "${test_args[@]}" --no-run --quiet

BIN=target/$TARGET/release/megatrain
file "$BIN" | grep -q 'ARM aarch64' || { echo "FAIL: $BIN is not an aarch64 executable" >&2; exit 1; }
glibc=$(aarch64-linux-gnu-objdump -T "$BIN" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
echo "aarch64 release binary: $BIN, $(du -m "$BIN" | cut -f1) MiB ($(stat -c %s "$BIN") bytes), needs $glibc, libhwloc.so.15 and libudev.so.1"

# The tests see an aarch64 CPU (qemu's "max" CPU: NEON, SVE, ...) and its hwcaps.
export QEMU_CPU=max
stage "library unit tests under qemu-user"
cargo test --release --target "$TARGET" -p megatrain --lib --quiet -- --test-threads 2 \
  --skip plan::tests:: --skip selftest::tests:: --skip every_fp32_pattern_round_trips
stage "integration tests under qemu-user: ${TESTS[*]}"
# Tests that start the megatrain binary start it through qemu too (tests/common: megatrain()).
MEGATRAIN_TEST_RUNNER=qemu-aarch64-static \
cargo test --release --target "$TARGET" -p megatrain "${test_args[@]}" --quiet -- --test-threads 2 "${no_reexec[@]}"

stage "megatrain train --demo --steps $DEMO_STEPS (aarch64 under qemu vs x86-64)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The x86-64 side: the test build's binary (tools/test.sh has built it; same arithmetic as release).
env -u RUSTC_WORKSPACE_WRAPPER cargo build --bin megatrain --quiet
for arch in x86_64 aarch64; do
  if [ "$arch" = aarch64 ]; then run=(qemu-aarch64-static "$BIN"); else run=(target/debug/megatrain); fi
  "${run[@]}" train --demo --demo-dir "$work/$arch" --steps "$DEMO_STEPS" \
    --batch-size 2 --seq-len 64 --grad-accum 1 >"$work/$arch.log" 2>&1 \
    || { cat "$work/$arch.log" >&2; echo "FAIL: the $arch demo failed" >&2; exit 1; }
done
python3 - "$work" "$DEMO_STEPS" <<'EOF'
import json, sys
work, steps = sys.argv[1], int(sys.argv[2])
def losses(arch):
    rows = [json.loads(l) for l in open(f"{work}/{arch}/demo/metrics.jsonl") if l.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r and "step" in r]
x, a = losses("x86_64"), losses("aarch64")
assert len(x) == steps and [s for s, _ in x] == [s for s, _ in a], (x, a)
# The GEMMs (the gemm crate's AVX and NEON kernels) sum in different orders: the losses agree to
# float rounding carried through the steps, not bit for bit (docs/aarch64.md).
worst = max(abs(lx - la) / abs(lx) for (_, lx), (_, la) in zip(x, a))
for (s, lx), (_, la) in zip(x, a):
    print(f"  step {s}: x86-64 {lx:.7f}  aarch64 {la:.7f}")
print(f"  largest relative difference {worst:.2e} (tolerance 1e-4)")
if worst > 1e-4:
    sys.exit("FAIL: the aarch64 demo's losses differ from x86-64's beyond 1e-4")
EOF
stage "PASS"
