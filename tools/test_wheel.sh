#!/usr/bin/env bash
# A wheel as a user meets it: `pip install` into a fresh venv, then `megatrain train --demo` and
# `megatrain probe` from that venv's PATH, with the system's own hwloc and udev hidden, so they run
# on the libraries the wheel bundles.
#
#   tools/test_wheel.sh WHEEL [DEMO_STEPS]      (tools/test.sh runs it on the x86_64 wheel)
#
# An aarch64 wheel cannot be installed here: it is unpacked and its binary runs `probe` under
# qemu-user, with Debian's arm64 hwloc and udev hidden.
#
# ldd must resolve hwloc and udev into the wheel's megatrain.libs/. Hiding the system's copies
# takes a mount namespace (root, `unshare`): each is bind-mounted over with /dev/null for the
# run; where that is refused the script says so, and the ldd check is what remains.
set -euo pipefail
whl="$1"
steps="${2:-20}"
[ -f "$whl" ] || { echo "test_wheel: no wheel at '$whl' (build it with tools/build_wheels.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Hides the given files for one command (bind-mounted over with /dev/null in a mount namespace);
# prints a NOTE and runs the command as it is where that is refused.
hidden() {
  local files="$1"; shift
  if [ -n "$files" ] && unshare --mount true 2>/dev/null; then
    HIDE="$files" unshare --mount bash -c 'for l in $HIDE; do mount --bind /dev/null "$l"; done; exec "$@"' hide "$@"
  else
    echo "NOTE: no mount namespace here (needs root and unshare): the system's hwloc and udev stay visible" >&2
    "$@"
  fi
}
# The system's own copies of the libraries the wheel bundles, for one architecture's loader.
system_libs() {
  local dir="$1" out=() f
  for f in "$dir"/libhwloc.so.15.* "$dir"/libudev.so.1.*; do [ -f "$f" ] && out+=("$(readlink -f "$f")"); done
  echo "${out[*]}"
}

case "$(basename "$whl")" in
  *_aarch64.whl)
    # Not installable on this x86_64 machine: unpacked instead, and its binary run under qemu-user
    # (tools/setup-deps.sh --aarch64) with Debian's arm64 hwloc and udev hidden.
    echo "-- $(date +%T) wheel: $(basename "$whl") unpacked, its binary under qemu-user"
    python3 -m zipfile -e "$whl" "$work/unpacked"
    bin="$work/unpacked/megatrain.scripts/megatrain"
    chmod +x "$bin"
    file "$bin" | grep -q 'ARM aarch64' || { echo "FAIL: $bin is not an aarch64 executable" >&2; exit 1; }
    hidden "$(system_libs /usr/lib/aarch64-linux-gnu)" qemu-aarch64-static "$bin" probe >"$work/probe.log" 2>&1 \
      || { cat "$work/probe.log" >&2; echo "FAIL: the aarch64 wheel's probe failed" >&2; exit 1; }
    grep -q "NUMA nodes" "$work/probe.log" || { cat "$work/probe.log" >&2; echo "FAIL: no probe output" >&2; exit 1; }
    grep -E "cores" "$work/probe.log" | head -1
    echo "-- $(date +%T) wheel: PASS ($(basename "$whl"), $(du -m "$whl" | cut -f1) MiB)"
    exit 0 ;;
esac

echo "-- $(date +%T) wheel: pip install $(basename "$whl") into a fresh venv"
python3 -m venv "$work/venv"
# --no-index: the wheel depends on nothing, so nothing else may come from a registry.
"$work/venv/bin/pip" install --quiet --no-index --disable-pip-version-check "$whl"
export PATH="$work/venv/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
[ "$(command -v megatrain)" = "$work/venv/bin/megatrain" ] \
  || { echo "FAIL: megatrain on PATH is '$(command -v megatrain)', not the venv's" >&2; exit 1; }
real=$("$work/venv/bin/python" -c \
  'import os, sysconfig; print(os.path.join(sysconfig.get_path("platlib"), "megatrain.scripts", "megatrain"))')

# The loader resolves hwloc and udev into the wheel, never the system's.
resolved=$(ldd "$real")
for lib in libhwloc libudev; do
  grep -Eq "^[[:space:]]*$lib-[0-9a-f]{8}\.so[.0-9]* => $work/venv/[^ ]*/megatrain\.libs/" <<<"$resolved" \
    || { echo "$resolved" >&2; echo "FAIL: $lib is not resolved from the wheel's megatrain.libs/" >&2; exit 1; }
done
if grep -Eq '/(usr/)?lib.*/lib(hwloc|udev)\.so' <<<"$resolved"; then
  echo "$resolved" >&2; echo "FAIL: the wheel's binary loads a system hwloc or udev" >&2; exit 1
fi

# The system's copies, hidden for the runs below.
hide=$(system_libs /usr/lib/x86_64-linux-gnu)
[ -n "$hide" ] && echo "-- hiding the system's $hide (bind-mounted over with /dev/null)"

echo "-- $(date +%T) wheel: megatrain train --demo --steps $steps"
hidden "$hide" megatrain train --demo --steps "$steps" --demo-dir "$work/demo" >"$work/demo.log" 2>&1 \
  || { cat "$work/demo.log" >&2; echo "FAIL: the demo from the wheel failed" >&2; exit 1; }
tail -n 7 "$work/demo.log"
python3 - "$work/demo/demo/metrics.jsonl" "$steps" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
losses = [r["loss"] for r in rows if "loss" in r and "step" in r]
steps = int(sys.argv[2])
assert len(losses) == steps, f"{len(losses)} training steps logged, expected {steps}"
assert losses[-1] < losses[0], f"the loss did not fall: {losses[0]} -> {losses[-1]}"
print(f"  {steps} steps logged, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
PY

echo "-- $(date +%T) wheel: megatrain probe"
hidden "$hide" megatrain probe >"$work/probe.log" 2>&1 \
  || { cat "$work/probe.log" >&2; echo "FAIL: probe from the wheel failed" >&2; exit 1; }
for want in "NUMA nodes" "CUDA driver:"; do
  grep -q "$want" "$work/probe.log" || { cat "$work/probe.log" >&2; echo "FAIL: probe printed no '$want'" >&2; exit 1; }
done
grep -E "cores|CUDA driver" "$work/probe.log"
echo "-- $(date +%T) wheel: PASS ($(basename "$whl"), $(du -m "$whl" | cut -f1) MiB)"
