#!/usr/bin/env python3
"""Micro-benchmark of the batched-decode matmuls on XLA:CPU (mid-config widths), interleaved.

Why: an engine decode step at batch 8 is ~80% routed-expert matmuls and ~20% dense projections
(`tools/profile_serve_step.py`), all weight-streaming GEMMs with few rows. This times, in one
process with interleaved repetitions (min and median: the machine may be shared):

* one MoE layer's routed experts (64 experts 256 × 1024, top-8, weights passed as jit arguments as
  in the engine) for N decode tokens: the capacity path as the model runs it
  (`moe_capacity.experts_capacity`, capacity C = `expert_capacity(N, 8, 64)`), the capacity path with
  smaller buffers (C = 4, 2; overflow goes through the exact spill loop), and "dense": every expert
  on every token as one `[N, D] × [E·I, D]ᵀ` GEMM per projection, combined with routing weights that
  are zero for unselected experts (tokens-last orientation); and the native CPU kernel
  (`pallas_kernels/experts`, each used expert read once for all its tokens): where its row limit
  (`moe_active.uses_active_loop`) should lie;
* a dense projection of the LM head's shape (W [32768, 1024]) at M = 1, 8, 32 rows.

Every alternative is checked against the capacity path (max relative difference printed).

  python tools/bench_moe_decode.py [--tokens 8,32] [--reps 9] [--only capacity,native]
                                  [--native-variant OTHER.cc ...]

`--native-variant` builds another version of `experts_decode.cc` (e.g. `git show REV:pallas_kernels/
experts/experts_decode.cc > old.cc`) and times it interleaved with the current one: a kernel change
measured side by side in one process.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ling_jax.moe_capacity import expert_capacity, experts_capacity  # noqa: E402
from ling_jax.swiglu import swiglu_act  # noqa: E402
from pallas_kernels.experts import cpu_kernel  # noqa: E402
from pallas_kernels.experts.panels import pack_panels  # noqa: E402

E, I, D, K = 64, 256, 1024, 8
HI = jax.lax.Precision.HIGHEST


def combine(y, wts):
    """Per-assignment outputs [N·k, D] → [N, D] weighted by the routing weights."""
    return jnp.einsum("nkd,nk->nd", y.reshape(wts.shape[0], K, -1), wts, precision=HI)


def capacity(C):
    return lambda x, idx, wts, wg, wu, wd: combine(experts_capacity(x, idx.reshape(-1), K, wg, wu, wd, 0.0, C), wts)


def dense(x, idx, wts, wg, wu, wd):
    """Every expert on every token; unselected experts get weight 0."""
    N = x.shape[0]
    w = jnp.zeros((N, E), jnp.float32).at[jnp.arange(N)[:, None], idx].set(wts)
    g = jnp.einsum("rd,nd->rn", wg.reshape(E * I, D), x, precision=HI).reshape(E, I, N)
    u = jnp.einsum("rd,nd->rn", wu.reshape(E * I, D), x, precision=HI).reshape(E, I, N)
    h = swiglu_act(g, u, 0.0) * w.T[:, None, :]
    return jnp.einsum("edi,ein->nd", wd, h, precision=HI)


def native(x, idx, wts, wg, wu, wd):
    """The native CPU kernel (`ExecConfig.native_experts`) at any token count."""
    return cpu_kernel.experts_decode_cpu(x, idx, wts, wg, wu, wd, 0.0)


def native_packed(x, idx, wts, wg, wu, wd):
    """The native kernel over weights stored in its panel order (`pallas_kernels/experts/panels.py`;
    packed once, outside the timed call)."""
    return cpu_kernel.experts_decode_cpu(x, idx, wts, wg, wu, wd, 0.0, packed=True)


def interleaved(cases: dict, reps: int) -> dict:
    """Times of each case over `reps` rounds, the order rotated every round. Why: a case timed right
    after the capacity path (whose large buffers evict the caches) ran ~5% slower than the same kernel
    timed later in the round (an A/A check, thirty-fifth session), which biased a variant comparison."""
    for f in cases.values():
        jax.block_until_ready(f())
    ts = {n: [] for n in cases}
    names = list(cases)
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            f = cases[n]
            t = time.perf_counter()
            jax.block_until_ready(f())
            ts[n].append(time.perf_counter() - t)
    return ts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8,32")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--only", default=None, help="comma list of variant prefixes (capacity, dense, native)")
    ap.add_argument("--native-variant", action="append", default=[], metavar="SOURCE.cc")
    a = ap.parse_args()
    variants = {f"native kernel ({os.path.basename(src)})": cpu_kernel.register_variant(src, f"ling_bench_variant_{i}")
                for i, src in enumerate(a.native_variant)}
    rng = np.random.default_rng(0)
    wg, wu = (jnp.asarray(rng.standard_normal((E, I, D), np.float32) * 0.03) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, D, I), np.float32) * 0.06)
    print(f"# XLA:CPU, load {os.getloadavg()[0]:.1f}; one MoE layer (64 x 256 x 1024, top-8), weights as arguments")
    print("| tokens | variant | min ms | median ms | max rel. diff vs model path |\n|---:|---|---:|---:|---:|")
    for N in (int(t) for t in a.tokens.split(",")):
        x = jnp.asarray(rng.standard_normal((N, D), np.float32))
        idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32))
        wts = jnp.asarray(rng.random((N, K), np.float32))
        c0 = expert_capacity(N, K, E)
        fns = {f"capacity C={c0} (model)": capacity(c0)}
        fns.update({f"capacity C={c}": capacity(c) for c in (4, 2) if c < c0})
        fns["dense (all experts)"] = dense
        if cpu_kernel.available():
            fns["native kernel (each used expert once)"] = native
            fns["native kernel, weights prepacked"] = native_packed
        for n, f in variants.items():
            fns[n] = lambda x, idx, wts, wg, wu, wd, f=f: f(x, idx, wts, wg, wu, wd, 0.0)
        if a.only:
            keep = tuple(v.strip() for v in a.only.split(","))
            fns = {n: f for i, (n, f) in enumerate(fns.items()) if i == 0 or n.startswith(keep)}
        jf = {n: jax.jit(f) for n, f in fns.items()}
        rows = (x, idx, wts, wg, wu, wd)
        packed = (x, idx, wts) + tuple(pack_panels(w) for w in (wg, wu, wd))
        args = {n: packed if fns[n] is native_packed else rows for n in jf}
        ref = np.asarray(next(iter(jf.values()))(*rows))
        diff = {n: float(np.abs(np.asarray(f(*args[n])) - ref).max() / np.abs(ref).max()) for n, f in jf.items()}
        ts = interleaved({n: (lambda f=f, n=n: f(*args[n])) for n, f in jf.items()}, a.reps)
        for n in jf:
            print(f"| {N} | {n} | {1e3 * min(ts[n]):.2f} | {1e3 * statistics.median(ts[n]):.2f} | {diff[n]:.1e} |",
                  flush=True)
    W = jnp.asarray(rng.standard_normal((32768, D), np.float32))
    lin = jax.jit(lambda x, W: jnp.einsum("bi,oi->bo", x, W, precision=HI))
    xs = {M: jnp.asarray(rng.standard_normal((M, D), np.float32)) for M in (1, 8, 32)}
    ts = interleaved({M: (lambda M=M: lin(xs[M], W)) for M in xs}, a.reps)
    print(f"\n| rows M | W [32768, 1024] ({W.nbytes / 1e6:.0f} MB) min ms | median ms | GB/s (min) | GFLOP/s (min) |")
    print("|---:|---:|---:|---:|---:|")
    for M in xs:
        t = min(ts[M])
        print(f"| {M} | {1e3 * t:.2f} | {1e3 * statistics.median(ts[M]):.2f} | {W.nbytes / t / 1e9:.1f} | "
              f"{2 * M * W.size / t / 1e9:.0f} |")


if __name__ == "__main__":
    main()
