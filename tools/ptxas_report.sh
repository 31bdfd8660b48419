#!/usr/bin/env bash
# ptxas' resource report (registers, spills, shared memory) for every kernel and architecture,
# from the PTX that NVRTC makes of kernels/*.cu. Writes docs/kernels-ptxas.md.
#   tools/ptxas_report.sh            (installs the wheels if needed; no GPU needed)
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(tools/setup-cuda-wheels.sh)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
MEGATRAIN_PTX_OUT="$out" MEGATRAIN_REQUIRE_NVRTC=1 \
    cargo test --quiet --features cuda --test kernels every_kernel >/dev/null
report=docs/kernels-ptxas.md
{
    echo "# ptxas resource report"
    echo
    echo "Written by \`tools/ptxas_report.sh\` ($("$MEGATRAIN_PTXAS" --version | tail -1)): PTX from NVRTC"
    echo "(\`src/device/kernels.rs\` options), assembled with \`ptxas -v\`. Spills are what to watch."
    echo
    echo "| kernel | arch | registers | spill stores | spill loads | shared (static) |"
    echo "|---|---|---|---|---|---|"
    for ptx in "$out"/*.ptx; do
        arch="${ptx##*.sm_}"; arch="sm_${arch%.ptx}"
        "$MEGATRAIN_PTXAS" -v --gpu-name "$arch" "$ptx" -o /dev/null 2>&1 | awk -v arch="$arch" '
            /Compiling entry function/ { match($0, /'\''[^'\'']+'\''/); k = substr($0, RSTART + 1, RLENGTH - 2) }
            /bytes spill stores/ { st = $(NF-7) ; ld = $(NF-3) }
            /Used [0-9]+ registers/ {
                match($0, /Used [0-9]+ registers/); r = substr($0, RSTART + 5, RLENGTH - 15)
                sm = "0"; if (match($0, /[0-9]+ bytes smem/)) sm = substr($0, RSTART, RLENGTH - 11)
                printf "| %s | %s | %s | %s | %s | %s B |\n", k, arch, r, st, ld, sm
            }'
    done | sort
} > "$report"
echo "wrote $report"
