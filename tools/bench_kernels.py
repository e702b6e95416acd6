#!/usr/bin/env python
"""Check every Pallas kernel against its XLA reference (the "twin") and time both at Ling-3.1-flash widths.

    python tools/bench_kernels.py --out bench.json            # on a GPU / TPU
    python tools/bench_kernels.py --smoke --out /tmp/b.json   # CPU: tiny shapes, interpret mode

Cases (real widths: 64 heads × 128, MLA latent 512 + rope 64, hidden 4096; batch 1 and 8):
  kda_chunk   prefill of 4096 tokens (float32 q/k/v/g as the model passes them)
  kda_step    one decode token, state [B,64,128,128] f32 (the kernel updates it in place)
  mla_decode  one query token against a bf16 latent cache of 4K / 32K tokens (all valid)
  fp8_linear  x [M,4096] bf16 @ dequant(W [8192,4096] e4m3, 128×128 scales).T, M = 1, 8, 4096

Each row prints the median wall time next to its floor: max(bytes moved ÷ HBM bandwidth,
FLOPs ÷ peak), with H200 defaults (4.8 TB/s, 990 TFLOP/s dense bf16; override with --hbm-tbps /
--peak-tflops). The floor counts the bytes the op must touch once (inputs, outputs, state) and the
useful FLOPs; KDA runs in float32, so its compute floor against the bf16 peak is optimistic. The
check column is the relative error ‖kernel − twin‖/‖twin‖ against the tolerance (float32 1e-5,
bf16 1e-2). Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.fp8.kernel import fp8_linear_pallas  # noqa: E402
from pallas_kernels.fp8.reference import fp8_linear  # noqa: E402
from pallas_kernels.kda.chunk_kernel import kda_chunk_scan_pallas  # noqa: E402
from pallas_kernels.kda.reference import kda_chunk_scan, kda_recurrent_step  # noqa: E402
from pallas_kernels.kda.step_kernel import kda_recurrent_step_pallas  # noqa: E402
from pallas_kernels.mla.kernel import latent_attention_pallas  # noqa: E402
from pallas_kernels.mla.reference import attention_mask, latent_attention  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _l2(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


# ---------------------------------------------------------------- cases
# Each case: dict(name, shape, dtype, make(key) -> args, kernel(*args), twin(*args), bytes, flops)

def kda_chunk_case(B, T, H, d, chunk=64):
    def make(key):
        ks = jax.random.split(key, 6)
        q = _l2(jax.random.normal(ks[0], (B, T, H, d), F32)) * d ** -0.5
        k = _l2(jax.random.normal(ks[1], (B, T, H, d), F32))
        v = jax.random.normal(ks[2], (B, T, H, d), F32)
        g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, d), F32))  # the bounded gate's range
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), F32))
        s0 = 0.1 * jax.random.normal(ks[5], (B, H, d, d), F32)
        return q, k, v, g, beta, s0

    C = min(chunk, T)
    per_tok_head = 2 * (3 * C * d + 2 * C * d + 3 * d * d + d * d)  # A, L, W / U, A·Ṽ; W·S, Q·S, Kᵀ·Ṽ
    return dict(name="kda_chunk", shape=f"B={B} T={T} H={H} d={d}", dtype="float32", make=make,
                kernel=lambda *a: kda_chunk_scan_pallas(*a, chunk),
                twin=lambda *a: kda_chunk_scan(*a, chunk),
                bytes=4 * (B * T * H * (5 * d + 1) + 2 * B * H * d * d), flops=B * T * H * per_tok_head)


def kda_step_case(B, H, d):
    def make(key):
        ks = jax.random.split(key, 6)
        q = _l2(jax.random.normal(ks[0], (B, H, d), F32)) * d ** -0.5
        k = _l2(jax.random.normal(ks[1], (B, H, d), F32))
        v = jax.random.normal(ks[2], (B, H, d), F32)
        g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, H, d), F32))
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, H), F32))
        s0 = 0.1 * jax.random.normal(ks[5], (B, H, d, d), F32)
        return s0, q, k, v, g, beta

    return dict(name="kda_step", shape=f"B={B} H={H} d={d}", dtype="float32", make=make,
                kernel=kda_recurrent_step_pallas, twin=kda_recurrent_step,
                bytes=4 * (2 * B * H * d * d + 5 * B * H * d), flops=6 * B * H * d * d, carry_state=True)


def mla_case(B, S, H, r, dr, T=1, **kernel_kw):
    scale = (128 + dr) ** -0.5

    def make(key):
        ks = jax.random.split(key, 4)
        return (jax.random.normal(ks[0], (B, T, H, r), BF16), jax.random.normal(ks[1], (B, T, H, dr), BF16),
                jax.random.normal(ks[2], (B, S, r), BF16), jax.random.normal(ks[3], (B, S, dr), BF16),
                jnp.full((B,), S, jnp.int32), jnp.broadcast_to(S - T + jnp.arange(T, dtype=jnp.int32), (B, T)))

    def twin(q_hat, q_pe, c, k_pe, kv_len, q_pos):
        return latent_attention(q_hat, q_pe, c, k_pe, attention_mask(q_pos, S, kv_len), scale)

    return dict(name="mla_decode", shape=f"B={B} T={T} S={S} H={H} r={r}+{dr}", dtype="bfloat16", make=make,
                kernel=lambda *a: latent_attention_pallas(*a, scale, **kernel_kw), twin=twin,
                bytes=2 * (B * S * (r + dr) + B * T * H * (2 * r + dr)), flops=2 * B * T * H * S * (2 * r + dr))


def fp8_case(M, N, K):
    def make(key):
        ks = jax.random.split(key, 3)
        x = jax.random.normal(ks[0], (M, K), BF16)
        wq = (jax.random.normal(ks[1], (N, K), F32) * 100).clip(-448, 448).astype(jnp.float8_e4m3fn)
        scale = jax.random.uniform(ks[2], (-(-N // 128), -(-K // 128)), F32, 1e-4, 1e-3)
        return x, wq, scale

    return dict(name="fp8_linear", shape=f"M={M} N={N} K={K}", dtype="bfloat16", make=make,
                kernel=fp8_linear_pallas, twin=fp8_linear,
                bytes=N * K + 4 * math.ceil(N / 128) * math.ceil(K / 128) + 2 * (M * K + M * N), flops=2 * M * N * K)


def build_cases(smoke: bool, batches):
    if smoke:
        return [kda_chunk_case(2, 40, 2, 16, chunk=16), kda_step_case(2, 2, 16),
                mla_case(2, 100, 2, 32, 16, T=2, block_s=32), fp8_case(3, 200, 300)]
    cases = []
    for B in batches:
        cases.append(kda_chunk_case(B, 4096, 64, 128))
    for B in batches:
        cases.append(kda_step_case(B, 64, 128))
    for S in (4096, 32768):
        for B in batches:
            cases.append(mla_case(B, S, 64, 512, 64))
    for M in list(batches) + [4096]:
        cases.append(fp8_case(M, 8192, 4096))
    return cases


# ---------------------------------------------------------------- timing

def _time(fn, args, warmup: int, iters: int, carry_state: bool = False):
    """Median wall time. carry_state: args[0] is a state that fn returns as out[1] and that is donated
    (decode-loop style: the step kernel then updates it in place instead of copying it first)."""
    if carry_state:
        first = fn(jnp.copy(args[0]), *args[1:])  # the result that gets checked, from the original state
        jax.block_until_ready(first)
        state = jnp.copy(args[0])

        def call():
            nonlocal state
            out = fn(state, *args[1:])
            state = out[1]
            return out
    else:
        first = fn(*args)
        jax.block_until_ready(first)

        def call():
            return fn(*args)

    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def _rel(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    errs = []
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        errs.append(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return max(errs)


def run_case(case, args, key):
    # Smoke runs on CPU only check that everything still traces, runs and agrees: compile cheaply.
    opts = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True} if (
        args.smoke and jax.default_backend() == "cpu") else None
    inputs = jax.jit(case["make"], compiler_options=opts)(key)
    jax.block_until_ready(inputs)
    carry = case.get("carry_state", False)
    donate = (0,) if carry else ()
    twin = jax.jit(case["twin"], donate_argnums=donate, compiler_options=opts)
    kernel = jax.jit(case["kernel"], donate_argnums=donate, compiler_options=opts)
    ref, t_twin = _time(twin, inputs, args.warmup, args.iters, carry)
    out, t_kernel = _time(kernel, inputs, args.warmup, args.iters, carry)
    err = _rel(out, ref)
    floor = max(case["bytes"] / (args.hbm_tbps * 1e12), case["flops"] / (args.peak_tflops * 1e12))
    return dict(name=case["name"], shape=case["shape"], dtype=case["dtype"], rel_err=err,
                tol=TOL[case["dtype"]], ok=bool(err < TOL[case["dtype"]]), bytes=case["bytes"], flops=case["flops"],
                floor_ms=floor * 1e3, pallas_ms=t_kernel * 1e3, xla_ms=t_twin * 1e3,
                pallas_pct_of_floor=100 * floor / t_kernel, xla_pct_of_floor=100 * floor / t_twin)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (interpret mode on CPU), one timed run")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (TB/s; H200 4.8)")
    ap.add_argument("--peak-tflops", type=float, default=990.0, help="dense bf16 peak for the floor (H200 ~990)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per op (median; default 20, smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs after compilation (default 2, smoke 0)")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--only", default="", help="comma-separated case names (kda_chunk,kda_step,mla_decode,fp8_linear)")
    args = ap.parse_args(argv)
    args.iters = args.iters or (1 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 2)
    batches = [int(b) for b in args.batches.split(",") if b]
    only = {s for s in args.only.split(",") if s}

    dev = jax.devices()[0]
    print(f"# device: {dev.platform} {getattr(dev, 'device_kind', '')}  (jax {jax.__version__}); floor = "
          f"max(bytes / {args.hbm_tbps} TB/s, FLOPs / {args.peak_tflops} TFLOP/s)\n")
    print("| kernel | shape | dtype | floor ms | pallas ms | % floor | xla ms | % floor | rel err | check |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    results = []
    for i, case in enumerate(build_cases(args.smoke, batches)):
        if only and case["name"] not in only:
            continue
        r = run_case(case, args, jax.random.PRNGKey(i))
        results.append(r)
        print(f"| {r['name']} | {r['shape']} | {r['dtype']} | {r['floor_ms']:.4g} | {r['pallas_ms']:.4g} | "
              f"{r['pallas_pct_of_floor']:.3g} | {r['xla_ms']:.4g} | {r['xla_pct_of_floor']:.3g} | "
              f"{r['rel_err']:.2e} | {'ok' if r['ok'] else 'FAIL'} |", flush=True)
    if args.out:
        meta = dict(device=f"{dev.platform} {getattr(dev, 'device_kind', '')}", jax=jax.__version__,
                    smoke=args.smoke, hbm_tbps=args.hbm_tbps, peak_tflops=args.peak_tflops, iters=args.iters)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
