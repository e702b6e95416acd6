"""One decode step's KDA recurrences over a slot pool: the XLA reference vs the native CPU kernel.

    python tools/bench_kda_decode.py [--rows 8,32] [--slots 32] [--layers 14] [--heads 8] [--dim 128] [--reps 9]

What the engine's decode step does per KDA layer, alone (the mid config: 14 KDA layers, 8 heads of
128 x 128 float32 states, 512 KiB per row and layer):
  xla     the rows gathered out of the stacked slot pool [layers, slots, H, dk, dv] (`rows.take_rows`),
          each layer's state read with a static slice, `reference.kda_recurrent_scan`, written back
          into the stacked rows, the rows scattered back into the pool (`rows.put_rows`): the engine's
          path before the kernel;
  native  `cpu_kernel.kda_recurrent_rows_cpu` on the pool itself, layer by layer (no gather, no scatter).
Both donate the pool. Interleaved, median of --reps (ms), beside the bytes each must move at least
(read + write every row's state once) and this machine's 2-thread copy rate.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="8,32")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from ling_jax.rows import put_rows, take_rows
    from pallas_kernels.kda.cpu_kernel import kda_recurrent_rows_cpu
    from pallas_kernels.kda.reference import kda_recurrent_scan

    S, Lr, H, d = args.slots, args.layers, args.heads, args.dim
    rng = np.random.default_rng(0)
    pool0 = (rng.standard_normal((1, Lr, S, H, d, d)) * 0.01).astype(np.float32)

    def xla(pool, rows, q, k, v, g, beta):
        st = take_rows(pool, rows, axis=2)  # [1, Lr, R, H, d, d]
        acc = 0.0
        for j in range(Lr):
            o, s = kda_recurrent_scan(q[j], k[j], v[j], g[j], beta[j], st[0, j])
            st = st.at[0, j].set(s)
            acc = acc + o.sum()
        return put_rows(pool, rows, st, axis=2), acc

    def native(pool, rows, q, k, v, g, beta):
        acc = 0.0
        for j in range(Lr):
            o, pool = kda_recurrent_rows_cpu(pool, rows, q[j], k[j], v[j], g[j], beta[j], layer=(0, j))
            acc = acc + o.sum()
        return pool, acc

    fns = {"xla": jax.jit(xla, donate_argnums=0), "native": jax.jit(native, donate_argnums=0)}
    x = np.ones(1 << 26, np.float32)
    t = time.perf_counter()
    for _ in range(5):
        x.copy()
    copy_gbps = 5 * 2 * x.nbytes / (time.perf_counter() - t) / 1e9
    out = {"args": vars(args), "copy_GBps_1thread": copy_gbps, "rows": []}
    for R in (int(r) for r in args.rows.split(",")):
        f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
        q = f(Lr, R, 1, H, d) * 0.05
        k = f(Lr, R, 1, H, d) * 0.05
        v, g = f(Lr, R, 1, H, d), -jnp.abs(f(Lr, R, 1, H, d)) * 0.1
        beta = jax.nn.sigmoid(f(Lr, R, 1, H))
        rows = jnp.asarray(rng.permutation(S)[:R].astype(np.int32))
        times = {n: [] for n in fns}
        pools = {n: jax.device_put(pool0) + 0.0 for n in fns}  # XLA-owned buffers (donated, carried)
        for it in range(args.reps + 1):
            for n, fn in fns.items():
                t = time.perf_counter()
                pools[n], acc = fn(pools[n], rows, q, k, v, g, beta)
                pools[n].block_until_ready()
                if it:
                    times[n].append(time.perf_counter() - t)
        diff = float(np.abs(np.asarray(pools["xla"]) - np.asarray(pools["native"])).max())
        need = 2 * Lr * R * H * d * d * 4  # read + write each row's state once
        row = {"rows": R, **{f"{n}_ms": 1e3 * float(np.median(v)) for n, v in times.items()},
               "state_bytes_rw": need, "max_abs_diff": diff}
        row["xla_over_native"] = row["xla_ms"] / row["native_ms"]
        out["rows"].append(row)
        print(f"rows {R}: xla {row['xla_ms']:.1f} ms, native {row['native_ms']:.1f} ms "
              f"({row['xla_over_native']:.2f}x); the states' bytes once each way {need / 1e6:.0f} MB = "
              f"{need / copy_gbps / 1e6:.1f} ms at {copy_gbps:.1f} GB/s; max |diff| {diff:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
