#!/usr/bin/env bash
# Install the Python packages that write datasets the way users have them — `pyarrow` (Parquet,
# Arrow IPC) and `datasets` (`save_to_disk`, `to_parquet`) — and the `tokenizers` package (the
# reference `bench`-style comparison of tokenization speed) into a venv at
# ${MEGATRAIN_DATA_VENV:-$HOME/.cache/megatrain/data-venv}, then print its python's path.
# tests/prepare_tables.rs uses it. Idempotent; needs the package registry the first time.
set -euo pipefail
own=1; [ -n "${MEGATRAIN_DATA_VENV:-}" ] && own=0
# Pinned: the versions the tests were last checked with.
exec bash "$(dirname "$0")/py-venv.sh" "${MEGATRAIN_DATA_VENV:-$HOME/.cache/megatrain/data-venv}" \
    "$own" "pyarrow, datasets, tokenizers" "pyarrow==22.0.0" "datasets==4.4.1" "tokenizers==0.22.1"
