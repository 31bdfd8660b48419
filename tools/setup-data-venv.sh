#!/usr/bin/env bash
# Install the Python packages that write datasets the way users have them — `pyarrow` (Parquet,
# Arrow IPC) and `datasets` (`save_to_disk`, `to_parquet`) — and the `tokenizers` package (the
# reference `bench`-style comparison of tokenization speed) into a venv at
# ${MEGATRAIN_DATA_VENV:-$HOME/.cache/megatrain/data-venv}, then print its python's path.
# tests/prepare_tables.rs uses it. Idempotent; needs the package registry the first time.
set -euo pipefail
dir="${MEGATRAIN_DATA_VENV:-$HOME/.cache/megatrain/data-venv}"
# Pinned: the versions the tests were last checked with.
pkgs=("pyarrow==22.0.0" "datasets==4.4.1" "tokenizers==0.22.1")
if [ -z "${MEGATRAIN_DATA_VENV:-}" ] && [ ! -x "$dir/bin/pip" ] && [ -f "$dir/pyvenv.cfg" ]; then
    rm -rf "$dir" # our own cache venv left without pip: made again
fi
if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -c 'import pyarrow, datasets, tokenizers' 2>/dev/null; then
    python3 -m venv "$dir" >&2
    "$dir/bin/pip" install --quiet --disable-pip-version-check "${pkgs[@]}" >&2
fi
echo "$dir/bin/python"
