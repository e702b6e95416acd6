#!/usr/bin/env python3
"""XLA:CPU linear layers over few rows: `x @ Wᵀ` as written against weights-first `(W @ xᵀ)ᵀ`.

Why: `ExecConfig.weights_first_rows` (pallas_kernels/matmul.py `linear`) switches a linear over
2 … that many rows to the weights-first form with an optimization barrier before the transpose;
this tool measures both forms side by side (interleaved, min of reps) at the mid config's widths
and the LM head's, so the threshold can be re-derived on another machine.

  python tools/bench_small_matmul.py [--rows 1,2,4,8,16,32,64,128,512] [--reps 10]
  python tools/bench_small_matmul.py --table [--layers 24]
      # a scanned loop's layers read from a stack [layers, out, in]: the native table-linear kernel
      # (`pallas_kernels.linear`, in place) against XLA's dynamic slice + dot and the unrolled loop;
      # ms per layer (`linear.reads_in_place` cites it)
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import linear

SHAPES = [(32768, 1024), (1024, 1024), (2816, 1024)]  # LM head; square projection; dense MLP (mid config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--table", action="store_true", help="the scanned-loop comparison (module doc)")
    p.add_argument("--layers", type=int, default=24, help="--table: layers stacked (the stack should not fit the "
                   "last-level cache, as a model's weights do not)")
    a = p.parse_args()
    if a.table:
        return table_rows(a)
    rng = np.random.default_rng(0)
    print("| W [out, in] | rows | x @ Wᵀ ms | weights-first ms | speed-up | weight GB/s (weights-first) |")
    print("|---|---:|---:|---:|---:|---:|")
    for O, I in SHAPES:
        w = jnp.asarray(rng.standard_normal((O, I), np.float32))
        for m in [int(r) for r in a.rows.split(",")]:
            x = jnp.asarray(rng.standard_normal((m, I), np.float32))
            plain = jax.jit(lambda x, w: linear(x, w, 0))
            first = jax.jit(lambda x, w: linear(x, w, 1 << 30))
            np.testing.assert_allclose(np.asarray(first(x, w)), np.asarray(plain(x, w)), rtol=1e-4, atol=1e-3)
            tp, tf = [], []
            for _ in range(a.reps):
                t = time.perf_counter(); plain(x, w).block_until_ready(); tp.append(time.perf_counter() - t)
                t = time.perf_counter(); first(x, w).block_until_ready(); tf.append(time.perf_counter() - t)
            print(f"| [{O}, {I}] | {m} | {min(tp) * 1e3:.3f} | {min(tf) * 1e3:.3f} | {min(tp) / min(tf):.2f}× | "
                  f"{O * I * 4 / min(tf) / 1e9:.1f} |")


def table_rows(a) -> None:
    """ms per layer of a `--layers`-layer scan over one linear whose weights are stacked [L, out, in]:
    the native kernel reading each layer's rows in place, XLA slicing them out (a copy) before its dot,
    and the loop unrolled (XLA's dot on each layer's own array), interleaved, min of --reps."""
    from pallas_kernels.linear.cpu_kernel import table_linear_cpu
    from pallas_kernels.linear.reference import table_linear

    L, rng = a.layers, np.random.default_rng(0)
    print(f"| W [out, in] x {L} layers | rows | native in place | XLA slice + dot | XLA unrolled | native / slice |")
    print("|---|---:|---:|---:|---:|---:|")
    for O, I in ((1024, 1024), (2816, 1024), (1024, 2816)):
        stack = jnp.asarray(rng.standard_normal((L, O, I), np.float32))
        table = stack.reshape(L * O, I)

        def scanned(fn):
            return jax.jit(lambda x: jax.lax.scan(lambda c, i: (c, fn(x, i)), 0.0, jnp.arange(L, dtype=jnp.int32))[1])
        for m in [int(r) for r in a.rows.split(",")]:
            x = jnp.asarray(rng.standard_normal((m, I), np.float32))
            fns = [scanned(lambda x, i: table_linear_cpu(x, table, i * O, O)),
                   scanned(lambda x, i: table_linear(x, table, i * O, O, 64)),
                   jax.jit(lambda x: jnp.stack([linear(x, stack[i], 64) for i in range(L)]))]
            ts = [[] for _ in fns]
            for f in fns:
                f(x).block_until_ready()
            for _ in range(a.reps):
                for f, t in zip(fns, ts):
                    t0 = time.perf_counter()
                    f(x).block_until_ready()
                    t.append(time.perf_counter() - t0)
            n, sl, un = (1e3 * min(t) / L for t in ts)
            print(f"| [{O}, {I}] | {m} | {n:.3f} | {sl:.3f} | {un:.3f} | {n / sl:.2f} |", flush=True)


if __name__ == "__main__":
    main()
