#!/usr/bin/env python3
"""The absorbed MLA core on XLA:CPU: the native kernel (`pallas_kernels.mla.cpu_kernel`) against the XLA
forms the model ran before it, one process, interleaved, min of `--reps` (ms), each beside its limit.

    python tools/bench_mla_cpu.py [--heads 4] [--rank 48] [--rope 16] [--keys 4096,16384,65536]
                                  [--chunk 2048] [--reps 7] [--calls decode,prefill] [--out FILE.json]
    python tools/bench_mla_cpu.py --cold [--order inorder|shuffled] --keys 262144 --calls decode [--reps 30]

Rows: decode (one query of H heads over S cached keys): XLA `latent_attention` (dense, what the model
runs for T ≤ 8) vs native over the contiguous cache and over 16-token pages in a shuffled pool (the
engine's); bandwidth = the keys' bytes S·(r + dr)·4 over the time. Prefill (a chunk of C queries at
the end of S keys, causal): XLA `blockwise_latent_attention` (blocks of 512) vs native; GFLOP/s =
2·H·(2r + dr) per query per visible key (the causal count) over the time. Defaults: the width of
`tools/bench_long_context.py`'s model (4 heads, r = 48, dr = 16).

`--cold` times the paged decode call as a long-context decode step meets it: its pool evicted from the
caches before each call (256 MiB written), median of `--reps`, beside its two floors measured in the same
sitting: the same call with the pool in cache (its compute; min) and a streaming read of its bytes out of
cache by all threads (`stream_read_gbs`, best of 20). "of floor" = cold / the larger floor: 1.0 is
compute and memory fully overlapped at the host's streaming rate. `--order inorder` lays the pages out
in sequence (a fresh engine's pool); the default shuffles them (a pool after churn).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_generate import stream_read_gbs  # noqa: E402  (the tools' host-rate probes live there)
from pallas_kernels.mla import cpu_kernel  # noqa: E402
from pallas_kernels.mla.blockwise import blockwise_latent_attention  # noqa: E402
from pallas_kernels.mla.reference import attention_mask, gather_pages, latent_attention  # noqa: E402


def interleaved(fns: dict, args: dict, reps: int, before=None, stat=min) -> dict:
    """{name: stat of its ms}, the functions called in turn `reps` times after one warm call each, in
    ABBA order; `before()` runs before each timed call (untimed)."""
    for n, f in fns.items():
        jax.block_until_ready(f(*args[n]))
    ms = {n: [] for n in fns}
    for i in range(reps):
        for n in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            if before is not None:
                before()
            t0 = time.perf_counter()
            jax.block_until_ready(fns[n](*args[n]))
            ms[n].append((time.perf_counter() - t0) * 1e3)
    return {n: float(stat(v)) for n, v in ms.items()}


def cold_decode(H, r, dr, P, S, reps, order, rng) -> dict:
    """The paged decode call over S keys: cold (pool evicted before each call; median ms), warm (the same
    pool in cache: 64 pages reused; min ms) and the streaming-read time of its bytes (best of 20)."""
    n_pages = S // P
    pool = lambda d: jnp.asarray(rng.standard_normal((n_pages, P, d)), jnp.float32)  # noqa: E731
    cpool, kpool = pool(r), pool(dr)
    pages = np.arange(n_pages) if order == "inorder" else rng.permutation(n_pages)
    tables = {"cold": jnp.asarray(pages[None], jnp.int32),
              "warm": jnp.asarray((np.arange(n_pages) % min(64, n_pages))[None], jnp.int32)}
    qh = jnp.asarray(rng.standard_normal((1, 1, H, r)), jnp.float32)
    qp = jnp.asarray(rng.standard_normal((1, 1, H, dr)), jnp.float32)
    kv, pos = jnp.full((1,), S, jnp.int32), jnp.full((1, 1), S - 1, jnp.int32)
    f = jax.jit(lambda bt: cpu_kernel.paged_latent_attention_cpu(qh, qp, cpool, kpool, bt, kv, pos, 0.1))
    for bt in tables.values():  # the call is checked against the XLA form of the pages it reads
        want = latent_attention(qh, qp, gather_pages(cpool, bt), gather_pages(kpool, bt),
                                attention_mask(pos, S, kv), 0.1)
        err = float(jnp.max(jnp.abs(f(bt) - want)))
        assert err < 1e-4 * max(1.0, float(jnp.max(jnp.abs(want)))), f"kernel != XLA form ({err})"
    flush = np.ones(256 << 18, np.float32)
    evict = lambda: np.add(flush, 1.0, out=flush)  # noqa: E731  (256 MiB written: the pool leaves the caches)
    cold = interleaved({"cold": f}, {"cold": (tables["cold"],)}, reps, before=evict, stat=np.median)["cold"]
    warm = interleaved({"warm": f}, {"warm": (tables["warm"],)}, reps)["warm"]
    nbytes = S * (r + dr) * 4
    stream = nbytes / stream_read_gbs(nbytes) / 1e6
    return dict(call="decode-cold", order=order, keys=S, heads=H, rank=r, rope=dr, cold_ms=cold, warm_ms=warm,
                stream_ms=stream, of_floor=cold / max(warm, stream))


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
    ap.add_argument("--cold", action="store_true",
                    help="decode only: the pool evicted before each call, beside its compute and streaming floors")
    ap.add_argument("--order", choices=("inorder", "shuffled"), default="shuffled", help="page order of --cold")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    assert cpu_kernel.available(), cpu_kernel.load_error()
    H, r, dr, P, C = a.heads, a.rank, a.rope, a.page, a.chunk
    rng = np.random.default_rng(0)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    rows = []
    if a.cold:
        print("| call | pages | keys | cold ms (median) | in cache ms | streaming read ms | of floor |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for S in (int(x) for x in a.keys.split(",")):
            row = cold_decode(H, r, dr, P, S, a.reps, a.order, rng)
            rows.append(row)
            print(f"| decode | {a.order} | {S:,} | {row['cold_ms']:.2f} | {row['warm_ms']:.2f} | "
                  f"{row['stream_ms']:.2f} | {row['of_floor']:.2f} |", flush=True)
        return _write(a.out, rows)
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
    return _write(a.out, rows)


def _write(out, rows) -> int:
    if out:
        with open(out, "w") as f:
            json.dump({"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
