"""`kda_recurrent_rows_cpu`: the gated delta rule token by token as a native CPU kernel (XLA FFI),
in place on a slot pool.

Same values as `reference.kda_recurrent_scan` (float32) for the rows it is given, computed by
`recurrent_cpu.cc`: each (row, head) state is read where it lies in the pool (a stacked pool
[M, slots, H, dk, dv] and a layer index, or a plain [B, H, dk, dv] state), takes the T tokens in
two passes per 64-column block that stay in cache, and is written back in place (the pool is
aliased to the result). Why native code: XLA:CPU runs the step as four or five passes over every
row's state, ~5x its bytes (a 32-row mid-config decode step: ~140 ms of ~800, BENCHMARKS.md "Serving,
fourteenth session"), and the engine copied the rows out of the pool and back around it.

Built on first use and cached (`pallas_kernels.native`); `available()` says whether it could be;
callers fall back to the reference when not. CPU only, float32 only, forward only (decode and
verify calls; prefill and training run the chunked scan).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native

TARGET = "ling_kda_recurrent"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recurrent_cpu.cc")
_KERNEL = native.NativeKernel(SOURCE, "LingKdaRecurrent", TARGET)


def available() -> bool:
    """True when the kernel is built, loaded and registered (once per process)."""
    return _KERNEL.available()


def load_error() -> str | None:
    return _KERNEL.load_error()


def kda_recurrent_rows_cpu(pool, rows, q, k, v, g, beta, fresh=None, layer=None, threads: int | None = None):
    """The T tokens of rows `rows` through the delta rule, their states read and written in `pool`.

    pool: [S, H, dk, dv] float32, or stacked [repeats, n, S, H, dk, dv] with `layer` = (g, j)
    (Python or traced ints); rows [R] int: distinct slots (an index outside [0, S) is a padding
    row: output zero, no state touched); q, k, g [R,T,H,dk]; v [R,T,H,dv]; beta [R,T,H] (prepared
    as `reference.kda_recurrent_scan` takes them); fresh [R] bool or None: rows whose state starts
    at zero (a new sequence in a reused slot). Returns (o [R,T,H,dv] float32, the pool with those
    rows' states after the T tokens). Donate or carry the pool so XLA updates it in place.
    Raises RuntimeError when not `available()`.
    """
    if not available():
        raise RuntimeError(f"the native CPU KDA kernel is not available: {load_error()}")
    for name, a in (("pool", pool), ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if a.dtype != jnp.float32:
            raise TypeError(f"kda_recurrent_rows_cpu: {name} must be float32, got {a.dtype}")
    if layer is None:
        if pool.ndim != 4:
            raise ValueError(f"kda_recurrent_rows_cpu: pool must be [S,H,dk,dv] without `layer`, got {pool.shape}")
        flat = jnp.zeros((), jnp.int32)
    else:
        if pool.ndim != 6:
            raise ValueError(f"kda_recurrent_rows_cpu: a stacked pool is [repeats,n,S,H,dk,dv], got {pool.shape}")
        flat = jnp.asarray(layer[0], jnp.int32) * pool.shape[1] + jnp.asarray(layer[1], jnp.int32)
    R = q.shape[0]
    fresh = jnp.zeros((R,), jnp.int32) if fresh is None else fresh.astype(jnp.int32)
    # the pool goes in as it is stored: a reshaped operand made XLA copy the whole pool around the call
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(v.shape, jnp.float32),
                                     jax.ShapeDtypeStruct(pool.shape, jnp.float32)),
                            input_output_aliases={0: 1})
    return call(pool, flat.reshape(()), rows.astype(jnp.int32), fresh, q, k, v, g, beta,
                threads=np.int64(int(threads or native.default_threads())))


def kda_recurrent_scan_cpu(q, k, v, g, beta, state, threads: int | None = None):
    """`reference.kda_recurrent_scan` (same arguments and results: o [B,T,H,dv], final state) as
    the native kernel over a plain state [B,H,dk,dv] (each row its own slot)."""
    rows = jnp.arange(state.shape[0], dtype=jnp.int32)
    return kda_recurrent_rows_cpu(state.astype(jnp.float32), rows, q, k, v, g, beta, threads=threads)
