"""The project's GGUF model as a Hugging Face directory vLLM's CPU build loads (vLLM reads
safetensors, not GGUF): transformers dequantizes the GGUF's weights to float32 (the values
the engine's own dequantization gives, up to the rounding of its products; `--dtype bfloat16`
rounds them to bfloat16) and writes them with the tokenizer and chat template.

    python bindings/vllm/tests/convert.py --gguf ~/.cache/mosaickv/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out models/smollm2-135m-f32
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the dtype the weights are written in (float32: the engine's values)")
    args = ap.parse_args()
    # one file, or shards with their index (save_pretrained shards large models)
    if any(os.path.exists(os.path.join(args.out, n))
           for n in ("model.safetensors", "model.safetensors.index.json")):
        print(f"{args.out}: already converted")
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, args.dtype))
    # The weights are plain tensors by now; transformers only refuses to save a model
    # it still marks as GGUF-quantized.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    cfg = os.path.join(args.out, "config.json")
    with open(cfg) as fh:
        c = json.load(fh)
    c.pop("quantization_config", None)
    with open(cfg, "w") as fh:
        json.dump(c, fh, indent=2)
    print(f"{args.out}: written")


if __name__ == "__main__":
    main()
