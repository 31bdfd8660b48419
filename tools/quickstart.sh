#!/usr/bin/env bash
# The main job on its embedded default. Until the trainer lands this probes the machine:
# where the GPUs, the memory and the NVMe drives are, and what is close to what.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-deps.sh
cargo run --release --quiet -- probe "$@"
