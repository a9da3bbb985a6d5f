#!/usr/bin/env bash
# Builds the CUDA test binaries on an x86-64 Linux machine with Rust (no GPU needed)
# and copies them, stripped, to ./carry/ (git-ignored) for scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p carry
out=$(cargo test --no-run --release -p mosaickv-optimized --features cuda --message-format=json 2>/dev/null \
  | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="mosaickv_optimized": print(m["executable"])')
for f in $out; do cp "$f" carry/optimized-tests; strip carry/optimized-tests; done
ls -la carry/
