#!/usr/bin/env bash
# GPU check for a machine with CUDA 13, PyTorch and Python but no Rust.
# Needs ./carry/ from scripts/build-gpu-carry.sh. Writes results under $OUT.
# Budget: under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
# NVRTC: the toolkit's, else the pip wheel's.
if [ -z "${MOSAICKV_NVRTC:-}" ]; then
  for c in /usr/local/cuda/lib64/libnvrtc.so.13 $(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib","libnvrtc.so.13"))' 2>/dev/null); do
    [ -f "$c" ] && export MOSAICKV_NVRTC=$c && break
  done
fi
echo "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
echo "nvrtc:  ${MOSAICKV_NVRTC:-not found}"
rc=0
echo "== CUDA backend tests"
timeout 240 ./carry/optimized-tests cuda:: --nocapture 2>&1 | tee "$OUT/cuda-tests.txt" || rc=1
echo "== PyTorch SDPA peer"
timeout 180 python3 scripts/sdpa_peer.py 2>&1 | tee "$OUT/sdpa.txt" || rc=1
# TODO(issue 6): carry/gpu_compare (full, Quest, MosaicKV on the device) is not written yet.
exit $rc
