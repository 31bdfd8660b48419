#!/usr/bin/env bash
# A Python venv of pinned packages, made once: `tools/py-venv.sh DIR OWN IMPORTS PKG...` makes
# (or keeps) the venv at DIR with PKG... installed unless `python -c "import IMPORTS"` already
# works there, then prints its python's path. OWN=1: DIR is our own cache (a venv left there
# without pip is made again); OWN=0: a venv the user named (never removed).
# The tools/setup-*.sh scripts call it; it needs the package registry the first time.
set -euo pipefail
dir="$1"; own="$2"; imports="$3"; shift 3
# Tests run in parallel may ask for the same venv at once: one makes it, the others wait for it.
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if [ "$own" = 1 ] && [ ! -x "$dir/bin/pip" ] && [ -f "$dir/pyvenv.cfg" ]; then
    rm -rf "$dir" # our own cache venv left without pip: made again
fi
if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -c "import $imports" 2>/dev/null; then
    python3 -m venv "$dir" >&2
    "$dir/bin/pip" install --quiet --disable-pip-version-check "$@" >&2
fi
echo "$dir/bin/python"
