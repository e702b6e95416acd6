#!/usr/bin/env python3
"""The absorbed MLA core on XLA:CPU: the native kernel (`pallas_kernels.mla.cpu_kernel`) against the XLA
forms the model ran before it, one process, interleaved, min of `--reps` (ms), each beside its limit.

    python tools/bench_mla_cpu.py [--heads 4] [--rank 48] [--rope 16] [--keys 4096,16384,65536]
                                  [--chunk 2048] [--reps 7] [--calls decode,prefill] [--out FILE.json]

Rows: decode (one query of H heads over S cached keys): XLA `latent_attention` (dense, what the model
runs for T ≤ 8) vs native over the contiguous cache and over 16-token pages in a shuffled pool (the
engine's); bandwidth = the keys' bytes S·(r + dr)·4 over the time. Prefill (a chunk of C queries at
the end of S keys, causal): XLA `blockwise_latent_attention` (blocks of 512) vs native; GFLOP/s =
2·H·(2r + dr) per query per visible key (the causal count) over the time. Defaults: the width of
`tools/bench_long_context.py`'s model (4 heads, r = 48, dr = 16).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.mla import cpu_kernel  # noqa: E402
from pallas_kernels.mla.blockwise import blockwise_latent_attention  # noqa: E402
from pallas_kernels.mla.reference import attention_mask, latent_attention  # noqa: E402


def interleaved(fns: dict, args: dict, reps: int) -> dict:
    """{name: min ms}, the functions called in turn `reps` times after one warm call each."""
    for n, f in fns.items():
        jax.block_until_ready(f(*args[n]))
    best = {n: float("inf") for n in fns}
    for _ in range(reps):
        for n, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args[n]))
            best[n] = min(best[n], (time.perf_counter() - t0) * 1e3)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rank", type=int, default=48)
    ap.add_argument("--rope", type=int, default=16)
    ap.add_argument("--keys", default="4096,16384,65536")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", default="decode,prefill", help="comma list of decode, prefill")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    assert cpu_kernel.available(), cpu_kernel.load_error()
    H, r, dr, P, C = a.heads, a.rank, a.rope, a.page, a.chunk
    rng = np.random.default_rng(0)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    rows = []
    print("| call | keys | XLA ms | native ms | native paged ms | XLA / native | native rate |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for S in (int(x) for x in a.keys.split(",")):
        c, kp = f32(1, S, r), f32(1, S, dr)
        n_pages = S // P + 7
        perm = rng.permutation(n_pages)[:S // P]
        cpool, kpool = np.asarray(rng.standard_normal((n_pages, P, r)), np.float32), \
            np.asarray(rng.standard_normal((n_pages, P, dr)), np.float32)
        cpool[perm], kpool[perm] = np.asarray(c).reshape(-1, P, r), np.asarray(kp).reshape(-1, P, dr)
        table = jnp.asarray(perm[None], jnp.int32)
        kv = jnp.full((1,), S, jnp.int32)
        for call, T in (("decode", 1), ("prefill", C)):
            if T > S or call not in a.calls.split(","):
                continue
            qh, qp = f32(1, T, H, r), f32(1, T, H, dr)
            pos = jnp.asarray((S - T + np.arange(T))[None], jnp.int32)
            if T == 1:
                xla = jax.jit(lambda qh, qp, c, kp, pos, kv: latent_attention(qh, qp, c, kp, attention_mask(pos, S, kv),
                                                                                0.1))
            else:
                xla = jax.jit(lambda qh, qp, c, kp, pos, kv: blockwise_latent_attention(qh, qp, c, kp, pos, kv, 0.1))
            nat = jax.jit(lambda qh, qp, c, kp, pos, kv: cpu_kernel.latent_attention_cpu(qh, qp, c, kp, pos, kv, 0.1))
            pag = jax.jit(lambda qh, qp, cp, kpp, bt, pos, kv: cpu_kernel.paged_latent_attention_cpu(
                qh, qp, cp, kpp, bt, kv, pos, 0.1))
            args = {"xla": (qh, qp, c, kp, pos, kv), "native": (qh, qp, c, kp, pos, kv),
                    "paged": (qh, qp, jnp.asarray(cpool), jnp.asarray(kpool), table, pos, kv)}
            got = {n: np.asarray(f(*args[n])) for n, f in (("xla", xla), ("native", nat), ("paged", pag))}
            err = max(float(np.max(np.abs(got[n] - got["xla"]))) for n in ("native", "paged"))
            assert err < 1e-4 * max(1.0, float(np.max(np.abs(got["xla"])))), f"kernel != XLA form ({err})"
            ms = interleaved({"xla": xla, "native": nat, "paged": pag}, args, a.reps if T == 1 else max(2, a.reps // 3))
            if T == 1:
                rate, unit = S * (r + dr) * 4 / ms["native"] / 1e6, "GB/s"
            else:
                pairs = T * (S - T) + T * (T + 1) / 2
                rate, unit = 2 * H * (2 * r + dr) * pairs / ms["native"] / 1e6, "GFLOP/s"
            row = dict(call=call, keys=S, queries=T, heads=H, rank=r, rope=dr, **{f"{k}_ms": v for k, v in ms.items()},
                       native_rate=rate, unit=unit)
            rows.append(row)
            print(f"| {call}{'' if T == 1 else f' [{T} queries]'} | {S:,} | {ms['xla']:.2f} | {ms['native']:.2f} | "
                  f"{ms['paged']:.2f} | {ms['xla'] / ms['native']:.1f}x | {rate:.1f} {unit} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
