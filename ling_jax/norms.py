"""RMSNorm, gated RMSNorm and L2 normalisation (spec §5)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Normalise in float32, cast back to x's dtype *before* the weight multiply (as the reference)."""
    x32 = x.astype(jnp.float32)
    r = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return r.astype(x.dtype) * w.astype(x.dtype)


def gated_rms_norm(o: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """KDA output norm: normalise → × weight → × sigmoid(gate), all float32 (spec §5.3)."""
    o32 = o.astype(jnp.float32)
    r = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    return r * w.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(Σx² + eps)` in float32: eps inside the root, on the sum (spec §5.2)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """`axis`: logical name of the normalised dimension (sharding/rules.py; replicated in practice)."""

    def __init__(self, width: int, eps: float, dtype, axis: str = "embed"):
        self.weight = nnx.Param(jnp.ones((width,), dtype), axes=(axis,))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)
