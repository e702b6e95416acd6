"""The (clamped) SwiGLU activation of spec §7.2, shared by the model and the kernels' references."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_act(gate: jax.Array, up: jax.Array, limit) -> jax.Array:
    """`min(SiLU(gate), λ) · clip(up, −λ, λ)`; plain SwiGLU when λ = 0 (spec §7.2). limit: a number
    or a traced scalar (0 = no clamp)."""
    a = jax.nn.silu(gate.astype(jnp.float32))
    u = up.astype(jnp.float32)
    if isinstance(limit, (int, float)):
        if limit:
            a, u = jnp.minimum(a, limit), jnp.clip(u, -limit, limit)
    else:  # traced per-layer limit: 0 means no clamp
        on = limit > 0
        a = jnp.where(on, jnp.minimum(a, limit), a)
        u = jnp.where(on, jnp.clip(u, -limit, limit), u)
    return (a * u).astype(gate.dtype)
