#!/usr/bin/env bash
# GPU check for a machine with CUDA 13, PyTorch and Python but no Rust (docs/GPU.md).
# Needs ./carry/ from scripts/build-gpu-carry.sh. Writes results under $OUT:
#   cuda-tests.txt, conformance-cuda.txt, gpu_compare.txt, gpu_compare.json (JSON lines),
#   sdpa.txt, sdpa.json, gpu_results.json (merged list) and gpu_results.txt (merged table).
# Budget: under 8 minutes; every step has its own timeout (sum 455 s) and the comparison
# skips contexts its own estimate says would pass its deadline.
# CONTEXTS / BATCH / STEPS override the comparison's shapes (defaults: 32K..1M, 1 and 8, 20).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
CONTEXTS=${CONTEXTS:-32768,131072,524288,1048576}
BATCH=${BATCH:-1,8}
STEPS=${STEPS:-20}
for f in optimized-tests conformance-cuda gpu_compare; do
  [ -x "carry/$f" ] || { echo "carry/$f missing: run scripts/build-gpu-carry.sh on a machine with Rust" >&2; exit 2; }
done
# NVRTC: the toolkit's, else the pip wheel's.
if [ -z "${MOSAICKV_NVRTC:-}" ]; then
  for c in /usr/local/cuda/lib64/libnvrtc.so.13 $(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib","libnvrtc.so.13"))' 2>/dev/null); do
    [ -f "$c" ] && export MOSAICKV_NVRTC=$c && break
  done
fi
echo "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"
echo "nvrtc:  ${MOSAICKV_NVRTC:-not found}"
echo "cpus:   $(nproc)"
rc=0
t0=$SECONDS
step() { echo "== $1 (at $((SECONDS - t0)) s)"; }

step "CUDA backend unit tests"
timeout 45 ./carry/optimized-tests cuda:: --nocapture 2>&1 | tee "$OUT/cuda-tests.txt" || rc=1

step "conformance suite, CUDA backend"
timeout 100 ./carry/conformance-cuda --include-ignored --nocapture 2>&1 | tee "$OUT/conformance-cuda.txt" || rc=1
if grep -q "^SKIPPED" "$OUT/conformance-cuda.txt"; then
  echo "conformance: SKIPPED on this machine (see above): not a device pass"; rc=1
fi

step "gpu_compare: full, Quest, MosaicKV (contexts $CONTEXTS, batch $BATCH)"
dump=$(mktemp -d)
timeout 250 ./carry/gpu_compare --contexts "$CONTEXTS" --batch "$BATCH" --steps "$STEPS" \
  --deadline-s 190 --json "$OUT/gpu_compare.json" --dump-dir "$dump" 2>&1 | tee "$OUT/gpu_compare.txt" || rc=1

step "PyTorch SDPA peer"
timeout 60 python3 scripts/sdpa_peer.py --contexts "$CONTEXTS" --batch "$BATCH" --steps "$STEPS" \
  --check "$dump" 2>&1 | tee "$OUT/sdpa.txt" || rc=1
rm -rf "$dump"

step "merged"
python3 scripts/gpu_merge.py "$OUT/gpu_compare.json" "$OUT/sdpa.json" "$OUT/gpu_results.json" \
  | tee "$OUT/gpu_results.txt" || rc=1
echo "done in $((SECONDS - t0)) s, rc=$rc; results in $OUT"
exit $rc
