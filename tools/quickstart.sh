#!/usr/bin/env bash
# The main job on its embedded default: train a small byte-level Llama on this repository's own
# docs and source, on the CPU device through the full streaming pipeline (host store, streamer,
# AdamW pool), about 3 minutes on 2 cores after the build. Extra arguments go to `megatrain train`
# (e.g. --steps 50, or --resume to continue an earlier demo). Outputs go under out/demo/ and are
# listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-deps.sh
cargo run --release --quiet -- train --demo "$@"
