"""KDA over long prompts: drift of the float32 chunked scan (prefill) and the float32 token-by-token
recurrence (decode) against a float64 recurrence, at 16K, 64K and 256K tokens (issue 22, item 3).

    python tools/measure_kda_drift.py [--lengths 16384,65536,262144] [--heads 2] [--dk 16] [--chunk 16,64]
        [--out tools/results/kda_drift.json]

Inputs are prepared the way the model makes them (`pallas_kernels.kda.reference`): q, k
L2-normalised (q scaled by 1/√dk), beta = σ(·), g the bounded log-decay L·σ(x) with L = -5 and x
drawn so that a quarter of the key channels decay slowly (g ≈ -5e-4 … -0.02: memory over
thousands of tokens, where rounding can accumulate) and the rest at the model's typical rates. The
float64 recurrence is `tests/np_reference.kda_recurrent`'s update, vectorised over heads. Reports,
per length: relative error (‖a−b‖/‖b‖) of the outputs over the whole prompt, of the last 1,024
outputs, and of the final state, for each float32 form; and chunked vs recurrent float32.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.kda.reference import kda_chunk_scan, kda_recurrent_scan  # noqa: E402


def prepared_inputs(T: int, H: int, dk: int, dv: int, seed: int = 0):
    """(q, k, v, g, beta) float32 [T,H,·] as the model prepares them (see the module docstring)."""
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((T, H, dk))) / np.sqrt(dk)
    k = unit(rng.standard_normal((T, H, dk)))
    v = rng.standard_normal((T, H, dv))
    slow = rng.random((H, dk)) < 0.25  # per key channel: slow (long memory) or typical decay
    x = np.where(slow, rng.normal(-8.0, 1.5, (T, H, dk)), rng.normal(-1.0, 1.5, (T, H, dk)))
    g = -5.0 / (1.0 + np.exp(-x))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((T, H))))
    return tuple(a.astype(np.float32) for a in (q, k, v, g, beta))


def recurrence_f64(q, k, v, g, beta):
    """The float64 token-by-token delta rule (spec §9.6): (o [T,H,dv], final state [H,dk,dv])."""
    q, k, v, g, beta = (a.astype(np.float64) for a in (q, k, v, g, beta))
    T, H, dk = k.shape
    S = np.zeros((H, dk, v.shape[-1]))
    o = np.empty((T, H, v.shape[-1]))
    eg = np.exp(g)
    for t in range(T):
        S *= eg[t][:, :, None]
        e = v[t] - np.einsum("hkv,hk->hv", S, k[t])
        S += (beta[t][:, None] * k[t])[:, :, None] * e[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o, S


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def measure(T: int, H: int, dk: int, chunks: list[int]) -> dict:
    q, k, v, g, beta = prepared_inputs(T, H, dk, dk)
    t0 = time.time()
    o64, s64 = recurrence_f64(q, k, v, g, beta)
    t64 = time.time() - t0
    batch = lambda a: jnp.asarray(a)[None]
    args = tuple(batch(a) for a in (q, k, v, g, beta))
    s0 = jnp.zeros((1, H, dk, dk), jnp.float32)
    forms = {}
    o, s = jax.jit(kda_recurrent_scan)(*args, s0)
    forms["recurrent f32"] = (np.asarray(o[0]), np.asarray(s[0]))
    for c in chunks:
        o, s = jax.jit(kda_chunk_scan, static_argnames="chunk_size")(*args, s0, chunk_size=c)
        forms[f"chunked f32 (chunk {c})"] = (np.asarray(o[0]), np.asarray(s[0]))
    row = {"tokens": T, "heads": H, "dk": dk, "float64_seconds": round(t64, 1), "forms": {}}
    rec_o = forms["recurrent f32"][0]
    for name, (o, s) in forms.items():
        row["forms"][name] = {"out_rel": rel(o, o64), "last1024_out_rel": rel(o[-1024:], o64[-1024:]),
                              "state_rel": rel(s, s64), "vs_recurrent_f32_out_rel": rel(o, rec_o)}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="16384,65536,262144")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dk", type=int, default=16)
    p.add_argument("--chunk", default="16,64")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    rows = []
    print("| tokens | form | outputs rel err vs f64 | last 1,024 outputs | final state | vs f32 recurrence |")
    print("|---|---|---|---|---|---|")
    for T in (int(x) for x in a.lengths.split(",")):
        row = measure(T, a.heads, a.dk, [int(c) for c in a.chunk.split(",")])
        rows.append(row)
        for name, m in row["forms"].items():
            print(f"| {T:,} | {name} | {m['out_rel']:.2e} | {m['last1024_out_rel']:.2e} | {m['state_rel']:.2e} | "
                  f"{m['vs_recurrent_f32_out_rel']:.2e} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
