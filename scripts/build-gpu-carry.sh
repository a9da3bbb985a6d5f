#!/usr/bin/env bash
# Builds the CUDA binaries on an x86-64 Linux machine with Rust (no GPU needed) and
# copies them, stripped, to ./carry/ (git-ignored) for scripts/gpu-check.sh:
#   carry/optimized-tests   the optimized crate's unit tests (filter `cuda::`)
#   carry/conformance-cuda  the conformance suite stamped for the CUDA backend
#   carry/gpu_compare       full vs Quest vs MosaicKV decode attention on the device
# CARGO_TARGET_DIR is honoured. Prints the carry size (the device run takes at most 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p carry
# Executables of the compiler-artifact messages whose target name is $1.
pick() {
  python3 -c 'import sys,json
want=sys.argv[1]
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==want: print(m["executable"])' "$1"
}
# $1 = carry name, $2 = target name, rest = cargo arguments.
build() {
  local name=$1 target=$2; shift 2
  local log; log=$(mktemp)
  if ! cargo "$@" --release --message-format=json 2>"$log" >"$log.json"; then
    cat "$log" >&2; rm -f "$log" "$log.json"; echo "build-gpu-carry: cargo $* failed" >&2; exit 1
  fi
  local exe; exe=$(pick "$target" <"$log.json" | tail -n 1)
  rm -f "$log" "$log.json"
  [ -n "$exe" ] || { echo "build-gpu-carry: no executable for target $target" >&2; exit 1; }
  cp "$exe" "carry/$name"; strip "carry/$name"
}
build optimized-tests mosaickv_optimized test --no-run -p mosaickv-optimized --features cuda --lib
build conformance-cuda cuda test --no-run -p mosaickv-conformance --features cuda --test cuda
build gpu_compare gpu_compare build -p mosaickv-optimized --features cuda --example gpu_compare
ls -la carry/
total=$(du -cb carry/optimized-tests carry/conformance-cuda carry/gpu_compare | tail -n 1 | cut -f1)
echo "carry total: $((total / 1024)) KiB (limit 64 MiB with everything else carried)"
[ "$total" -lt $((48 * 1024 * 1024)) ] || { echo "build-gpu-carry: carry over 48 MiB" >&2; exit 1; }
