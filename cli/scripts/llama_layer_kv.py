"""K/V/Q .npy files of one Llama-3.1-8B attention layer's shape for timing `mosaickv attend`.

    python3 cli/scripts/llama_layer_kv.py OUT_DIR [TOKENS]

Writes OUT_DIR/K.npy, V.npy ([TOKENS, 8, 128] float16) and Q.npy ([32, 128] float32).
Keys are structured like real ones: per head a low-rank part that drifts slowly along
the sequence, a few large-magnitude channels, small noise; values are low-rank plus noise;
query head h (GQA group 4) looks for one token of its KV head h // 4.
"""

import sys

import numpy as np

out = sys.argv[1]
T = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
KVH, QH, D, R = 8, 32, 128, 16
G = QH // KVH
rng = np.random.default_rng(0)

basis = rng.standard_normal((KVH, R, D)).astype(np.float32) / np.sqrt(R)
K = np.empty((T, KVH, D), np.float16)
V = np.empty((T, KVH, D), np.float16)
state = rng.standard_normal((KVH, R)).astype(np.float32)
outlier = np.zeros(D, np.float32)
outlier[rng.choice(D, 4, replace=False)] = 8.0
CH = 4096
for t0 in range(0, T, CH):
    n = min(CH, T - t0)
    # A random walk of the low-rank coefficients, pulled back towards 0 (drift, not noise).
    steps = 0.05 * rng.standard_normal((n, KVH, R)).astype(np.float32)
    coef = state[None] + np.cumsum(steps, axis=0)
    state = 0.98 * coef[-1]
    k = np.einsum("thr,hrd->thd", coef, basis) + outlier
    k += 0.05 * rng.standard_normal((n, KVH, D)).astype(np.float32)
    K[t0 : t0 + n] = k.astype(np.float16)
    v = np.einsum("thr,hrd->thd", rng.standard_normal((n, KVH, R)).astype(np.float32), basis)
    v += 0.05 * rng.standard_normal((n, KVH, D)).astype(np.float32)
    V[t0 : t0 + n] = v.astype(np.float16)

target = rng.integers(0, T, QH)
Q = np.stack([K[target[h], h // G].astype(np.float32) for h in range(QH)])
Q += 0.1 * rng.standard_normal(Q.shape).astype(np.float32)
np.save(f"{out}/K.npy", K)
np.save(f"{out}/V.npy", V)
np.save(f"{out}/Q.npy", Q.astype(np.float32))
print(f"wrote {out}/K.npy, V.npy [{T}, {KVH}, {D}] float16 and Q.npy [{QH}, {D}] float32")
