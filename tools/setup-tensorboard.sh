#!/usr/bin/env bash
# Install the `tensorboard` Python package (what reads `megatrain train --tensorboard DIR`'s
# event files back in tests/tensorboard.rs, and what users run: `tensorboard --logdir DIR`)
# into a venv at ${MEGATRAIN_TB_VENV:-$HOME/.cache/megatrain/tensorboard-venv}, then print its
# python's path. Idempotent; needs the package registry the first time.
set -euo pipefail
dir="${MEGATRAIN_TB_VENV:-$HOME/.cache/megatrain/tensorboard-venv}"
# Pinned: the version the reader test was last checked with.
pkg="tensorboard==2.21.0"
if [ -z "${MEGATRAIN_TB_VENV:-}" ] && [ ! -x "$dir/bin/pip" ] && [ -f "$dir/pyvenv.cfg" ]; then
    rm -rf "$dir" # our own cache venv left without pip: made again
fi
if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -c 'import tensorboard' 2>/dev/null; then
    python3 -m venv "$dir" >&2
    "$dir/bin/pip" install --quiet --disable-pip-version-check "$pkg" >&2
fi
echo "$dir/bin/python"
