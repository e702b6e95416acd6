"""The precision policy of every XLA matmul: `linear`, `einsum`, `precision`.

It lives here, below the model, because the pure-XLA references of the kernels (`mla.reference`,
`fp8.reference`) must compute exactly what the model computes, and this package imports nothing of
the model; `ling_jax.ops` re-exports these names for the model's own projections.

float32 mode means float32 on TPU/GPU too: default precision there rounds operands to bf16 and
flips MoE routing decisions, so float32 matmuls run at `Precision.HIGHEST`. bfloat16 mode keeps
bf16 operands with float32 accumulation, as the reference does.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def precision(dtype) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def linear(x: jax.Array, w: jax.Array, weights_first_rows: int = 0) -> jax.Array:
    """`x @ w.T` for a weight stored `[out, in]` (the checkpoint layout); result in x's dtype.

    weights_first_rows: when x has 2 … this many rows (the product of its leading dims), compute
    `(w @ xᵀ)ᵀ` with the transpose kept apart from the product by an optimization barrier. Why:
    XLA:CPU's GEMM for an `[M, out]` result repacks the whole weight on every call, while for the
    `[out, M]` one the weight is the operand it streams in place; XLA folds a plain transpose back
    into the product, hence the barrier. Same value (one dot product per output), measured 1.6–2.3×
    faster at 2–16 rows, 1.0–1.2× at 64, slower from ~128 (tools/bench_small_matmul.py); 0 = off."""
    rows = math.prod(x.shape[:-1])
    if 2 <= rows <= weights_first_rows:
        xm = x.reshape(rows, x.shape[-1])
        yt = jnp.einsum("oi,ni->on", w.astype(x.dtype), xm, precision=precision(x.dtype),
                        preferred_element_type=_acc(x.dtype))
        return jax.lax.optimization_barrier(yt).T.reshape(*x.shape[:-1], w.shape[0]).astype(x.dtype)
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=precision(x.dtype),
                      preferred_element_type=_acc(x.dtype)).astype(x.dtype)


def _acc(dtype):
    # float32 operands accumulate in float32; bf16 ones use the backend's native bf16 dot (which
    # accumulates in float32 internally on TPU/GPU; XLA:CPU has no bf16 x bf16 -> f32 kernel).
    return jnp.float32 if jnp.dtype(dtype) == jnp.float32 else None


def einsum(spec: str, *xs, dtype=None) -> jax.Array:
    """einsum at the policy's precision with float32 accumulation, cast to `dtype` (default: first operand's)."""
    dtype = dtype or xs[0].dtype
    return jnp.einsum(spec, *xs, precision=precision(xs[0].dtype),
                      preferred_element_type=_acc(xs[0].dtype)).astype(dtype)
