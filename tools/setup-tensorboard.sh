#!/usr/bin/env bash
# Install the `tensorboard` Python package (what reads `megatrain train --tensorboard DIR`'s
# event files back in tests/tensorboard.rs, and what users run: `tensorboard --logdir DIR`)
# into a venv at ${MEGATRAIN_TB_VENV:-$HOME/.cache/megatrain/tensorboard-venv}, then print its
# python's path. Idempotent; needs the package registry the first time.
set -euo pipefail
own=1; [ -n "${MEGATRAIN_TB_VENV:-}" ] && own=0
# Pinned: the version the reader test was last checked with.
exec bash "$(dirname "$0")/py-venv.sh" "${MEGATRAIN_TB_VENV:-$HOME/.cache/megatrain/tensorboard-venv}" \
    "$own" tensorboard "tensorboard==2.21.0"
