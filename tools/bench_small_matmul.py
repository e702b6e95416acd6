#!/usr/bin/env python3
"""XLA:CPU linear layers over few rows: `x @ Wᵀ` as written against weights-first `(W @ xᵀ)ᵀ`.

Why: `ExecConfig.weights_first_rows` (pallas_kernels/matmul.py `linear`) switches a linear over
2 … that many rows to the weights-first form with an optimization barrier before the transpose;
this tool measures both forms side by side (interleaved, min of reps) at the mid config's widths
and the LM head's, so the threshold can be re-derived on another machine.

  python tools/bench_small_matmul.py [--rows 1,2,4,8,16,32,64,128,512] [--reps 10]
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
    a = p.parse_args()
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


if __name__ == "__main__":
    main()
