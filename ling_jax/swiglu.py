"""SwiGLU with the per-layer clamp of late MoE layers (spec §7.2): the dense FFN, the shared
expert, and the activation the routed experts use."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.exec_config import ExecConfig
from ling_jax.linear import Linear
from pallas_kernels.swiglu import swiglu_act as _swiglu_act


class SwiGLULimit(nnx.Variable):
    """Per-layer clamp limit λ (0 = none). A variable, not a static attribute, so layers with
    different limits share one compiled body when the layer stack is scanned; not trained."""


def swiglu_act(gate: jax.Array, up: jax.Array, limit) -> jax.Array:
    """`min(SiLU(gate), λ) · clip(up, −λ, λ)`; plain SwiGLU when λ = 0 (spec §7.2): the kernels'
    shared activation (`pallas_kernels.swiglu`), taking a layer's `SwiGLULimit` variable too."""
    if isinstance(limit, nnx.Variable):
        limit = limit[...]
    return _swiglu_act(gate, up, limit)


class SwiGLU(nnx.Module):
    """Dense FFN and the shared expert: `down(act(gate(x), up(x)))`."""

    def __init__(self, d: int, inter: int, *, dtype, rngs: nnx.Rngs, limit: float | None = None):
        self.gate_proj = Linear(d, inter, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, inter, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, d, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.limit = SwiGLULimit(jnp.asarray(limit, jnp.float32), axes=()) if limit is not None else None

    def __call__(self, x, ex: ExecConfig | None = None):
        """x: [..., d] → [..., d]; `ex.kernels` runs quantised projections (see ling_jax/linear.py)."""
        h = swiglu_act(self.gate_proj(x, ex), self.up_proj(x, ex), 0.0 if self.limit is None else self.limit[...])
        return self.down_proj(h, ex)
