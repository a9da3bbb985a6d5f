#!/usr/bin/env bash
# GPU check for a machine with CUDA 13, PyTorch and Python but no Rust (docs/GPU.md).
# Needs ./carry/ from scripts/build-gpu-carry.sh. Writes results under $OUT:
#   cuda-tests.txt, conformance-cuda.txt, gpu_compare.txt, gpu_compare.json (JSON lines),
#   sdpa.txt, sdpa.json, gpu_results.json (merged list) and gpu_results.txt (merged table).
# The conformance step includes the CudaCache checks (all 4 must print their marker) and
# runs every value dtype (f16, int8, int4: the default configuration stores quantized
# records), and gpu_compare must write cudacache and cc_swap rows at every batch size for
# both MosaicKV configurations (`*_default`: CompressConfig::default(), int4/int8/f16
# values; unsuffixed: paper_fixed(), f16).
# Budget: under 9 minutes; every step has its own timeout (sum 505 s) and the comparison
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
# NVRTC: the toolkit's, else a pip wheel's under any `nvidia` namespace directory
# (CUDA 13 wheels: cu13/lib/libnvrtc.so.13; CUDA 12 wheels, e.g. a PyTorch built on 12.x:
# cuda_nvrtc/lib/libnvrtc.so.12). The backend searches the same places itself
# (kernels/src/nvrtc.rs nvrtc_search_paths); this only makes the choice visible.
if [ -z "${MOSAICKV_NVRTC:-}" ]; then
  for c in /usr/local/cuda/lib64/libnvrtc.so.13 /usr/local/cuda/lib64/libnvrtc.so.12 \
      $(python3 -c 'import nvidia,os
for d in nvidia.__path__:
  for w in ("cu13/lib/libnvrtc.so.13","cuda_nvrtc/lib/libnvrtc.so.13","cu12/lib/libnvrtc.so.12","cuda_nvrtc/lib/libnvrtc.so.12"):
    print(os.path.join(d,w))' 2>/dev/null); do
    [ -f "$c" ] && export MOSAICKV_NVRTC=$c && break
  done
fi
echo "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"
echo "nvrtc:  ${MOSAICKV_NVRTC:-not found}"
echo "cpus:   $(nproc)"
rc=0
t0=$SECONDS
step() { echo "== $1 (at $((SECONDS - t0)) s)"; }
# A step passes only if it ran: exit 0, no "skipped"/"SKIPPED"/"ignored" test, and the
# marker line it must print when it really ran on the device.
fail_step() { echo "FAILED: $1"; rc=1; }
check_ran() {  # check_ran NAME LOG EXIT MARKER
  local name=$1 log=$2 code=$3 marker=$4
  [ "$code" = 0 ] || fail_step "$name exited $code"
  if grep -qiE "(^|[^a-z])skipped|SKIPPED" "$log"; then fail_step "$name: something was skipped (see $log): not a device pass"; fi
  if grep -qE "[1-9][0-9]* ignored" "$log"; then fail_step "$name: ignored tests (see $log)"; fi
  grep -q "$marker" "$log" || fail_step "$name: did not print '$marker': it did not run on the device"
}

step "glibc the carried binaries need"
# Assumed image: a stock CUDA 13 + PyTorch container on Ubuntu 22.04, glibc 2.35 (the
# older of the two Ubuntu releases CUDA 13 images ship on; 24.04 has 2.39).
GLIBC_HAVE=$(ldd --version 2>/dev/null | head -1 | grep -oE '[0-9]+\.[0-9]+$')
GLIBC_ASSUMED=2.35
for f in carry/optimized-tests carry/conformance-cuda carry/gpu_compare; do
  need=$(objdump -T "$f" 2>/dev/null | grep -oE 'GLIBC_[0-9]+\.[0-9]+(\.[0-9]+)?' | sed 's/GLIBC_//' | sort -V | tail -1)
  echo "$f needs glibc ${need:-?}; this machine has ${GLIBC_HAVE:-?}; assumed image $GLIBC_ASSUMED"
  [ -n "$need" ] || { fail_step "objdump -T $f gave no GLIBC_ version (objdump missing?)"; continue; }
  [ "$(printf '%s\n%s\n' "$need" "$GLIBC_ASSUMED" | sort -V | tail -1)" = "$GLIBC_ASSUMED" ] \
    || fail_step "$f needs glibc $need > $GLIBC_ASSUMED: rebuild the carry on an older glibc"
done

step "CUDA backend unit tests"
timeout 45 ./carry/optimized-tests cuda:: --include-ignored --nocapture > "$OUT/cuda-tests.txt" 2>&1
code=$?; cat "$OUT/cuda-tests.txt"
check_ran "CUDA unit tests" "$OUT/cuda-tests.txt" $code "CUDA available:"

step "conformance suite, CUDA backend"
timeout 150 ./carry/conformance-cuda --include-ignored --nocapture > "$OUT/conformance-cuda.txt" 2>&1
code=$?; cat "$OUT/conformance-cuda.txt"
check_ran "conformance (CUDA)" "$OUT/conformance-cuda.txt" $code "CUDA available: the suite above ran on the device"
# The CudaCache checks (conformance/tests/cuda_cache/mod.rs) each print this line at their end.
cc_ran=$(grep -c "CudaCache conformance ran on:" "$OUT/conformance-cuda.txt")
[ "$cc_ran" = 5 ] || fail_step "CudaCache conformance: $cc_ran of its 5 tests ran to the end on the device"

step "gpu_compare: full, Quest, MosaicKV default and paper (contexts $CONTEXTS, batch $BATCH)"
dump=$(mktemp -d)
timeout 250 ./carry/gpu_compare --contexts "$CONTEXTS" --batch "$BATCH" --steps "$STEPS" \
  --deadline-s 190 --json "$OUT/gpu_compare.json" --dump-dir "$dump" 2>&1 | tee "$OUT/gpu_compare.txt"
[ "${PIPESTATUS[0]}" = 0 ] || fail_step "gpu_compare exited ${PIPESTATUS[0]}"
[ -s "$OUT/gpu_compare.json" ] || fail_step "gpu_compare wrote no JSON"
# CudaCache (decode steps with appends, and a segment swap) at every batch size asked for.
for b in ${BATCH//,/ }; do
  for m in cudacache cc_swap cudacache_default cc_swap_default; do
    grep -q "\"method\": \"$m\", \"context\": [0-9]*, \"batch\": $b," "$OUT/gpu_compare.json" 2>/dev/null \
      || fail_step "gpu_compare: no $m row at batch $b"
  done
done

step "PyTorch SDPA peer"
timeout 60 python3 scripts/sdpa_peer.py --contexts "$CONTEXTS" --batch "$BATCH" --steps "$STEPS" \
  --check "$dump" 2>&1 | tee "$OUT/sdpa.txt"
[ "${PIPESTATUS[0]}" = 0 ] || fail_step "PyTorch SDPA peer exited ${PIPESTATUS[0]}"
[ -s "$OUT/sdpa.json" ] || fail_step "the SDPA peer wrote no JSON"
rm -rf "$dump"

step "merged"
python3 scripts/gpu_merge.py "$OUT/gpu_compare.json" "$OUT/sdpa.json" "$OUT/gpu_results.json" \
  | tee "$OUT/gpu_results.txt"
[ "${PIPESTATUS[0]}" = 0 ] || fail_step "merge exited ${PIPESTATUS[0]}"
echo "done in $((SECONDS - t0)) s, rc=$rc; results in $OUT"
[ $rc = 0 ] || echo "gpu-check FAILED: see the FAILED lines above" >&2
exit $rc
