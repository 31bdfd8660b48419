#!/usr/bin/env bash
# The test suite: formatting, lints (default and `cuda` feature), and every test.
# This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-deps.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --quiet -- -D warnings
echo "== cargo clippy --all-targets --features cuda -- -D warnings (no CUDA toolkit needed)"
cargo clippy --all-targets --features cuda --quiet -- -D warnings
echo "== cargo test"
cargo test --all-targets
