"""Sampling a batch of rows on CPU: the sort-free masking (`sampling.sample_rows`) against a stable sort
of every whole row (`sampling._processed_logits_rows_sorted`, what every sampled step ran before),
same keys, same tokens (asserted). [32, 32768] float32 logits (the mid config's vocabulary), temperature
0.8, min of 12 interleaved runs.

    python tools/bench_sampling.py
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax import sampling as S

R, V = 32, 32768
CASES = [("flat logits (std 3): top_p 0.9, nucleus past 256", 3.0, 0, 0.9),
         ("peaked logits (std 8): top_p 0.9, nucleus within 256", 8.0, 0, 0.9),
         ("top_k 40, top_p 0.9", 3.0, 40, 0.9),
         ("temperature only (top_k 0, top_p 1)", 3.0, 0, 1.0)]


def main() -> None:
    base = np.random.default_rng(0).standard_normal((R, V)).astype(np.float32)
    keys = S.request_keys(jnp.arange(R, dtype=jnp.uint32), jnp.zeros((R,), jnp.int32))
    t = jnp.full((R,), 0.8)
    print("| logits, settings | whole-row sort ms | sort-free ms |\n|---|---:|---:|")
    for name, sd, top_k, top_p in CASES:
        x = jnp.asarray(base * sd)
        k, p = jnp.full((R,), top_k, jnp.int32), jnp.full((R,), top_p)
        new = jax.jit(lambda x: S.sample_rows(x, keys, t, k, p))
        old = jax.jit(lambda x: jax.vmap(lambda kr, row: jax.random.categorical(kr, row[None])[0])(
            keys, S._processed_logits_rows_sorted(x / t[:, None], jnp.where(k > 0, k, V), p)))
        assert (np.asarray(new(x)) == np.asarray(old(x))).all(), name
        res = {"new": [], "old": []}
        for _ in range(12):
            for n, f in (("new", new), ("old", old)):
                a = time.perf_counter()
                f(x).block_until_ready()
                res[n].append(time.perf_counter() - a)
        print(f"| {name} | {min(res['old']) * 1e3:.1f} | {min(res['new']) * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
