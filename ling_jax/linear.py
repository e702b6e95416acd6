"""Bias-free linear layer holding its weight in the checkpoint's `[out, in]` layout.

The weight is a float array or, when a checkpoint's FP8 matrix is kept quantised, a `BlockFP8`
(float8_e4m3fn values + float32 block scales, `ling_jax.quantized`): one class, dispatching on what
the weight is. A BlockFP8 weight is dequantised inside the matmul: `ex.kernels == "pallas"` runs
the Pallas FP8 kernel (interpret mode on CPU), "xla" its pure-XLA reference. `matrix(dtype)` gives
the (dequantised) weight itself for code that needs it (MLA's absorbed `kv_b_proj`).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.exec_config import ExecConfig
from ling_jax.kernel_mesh import fp8_linear_on_mesh
from ling_jax.ops import linear
from ling_jax.placement import param_mesh
from ling_jax.quantized import BlockFP8, dequantize
from pallas_kernels.fp8.kernel import fp8_linear_pallas
from pallas_kernels.fp8.reference import fp8_linear


def init_normal(rngs: nnx.Rngs, shape, dtype, fan_in: int | None = None):
    """N(0, 1/fan_in): keeps activations O(1) in randomly initialised models."""
    fan_in = fan_in or shape[-1]
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)


class Linear(nnx.Module):
    """`weight` [out, in]: a float array, or a `BlockFP8` when the checkpoint's FP8 matrix is kept
    quantised. `axes` = (logical name of `out`, of `in`) (vocabulary: sharding/rules.py), declared
    here so the sharding rules place the weight without knowing its path."""

    def __init__(self, in_features: int, out_features: int, *, axes: tuple, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (out_features, in_features), dtype), axes=tuple(axes))

    def __call__(self, x: jax.Array, ex: ExecConfig | None = None) -> jax.Array:
        """`x @ weight.T` in x's dtype; a BlockFP8 weight is dequantised inside the matmul by the
        kernel `ex.kernels` selects (the dequantised weight is never stored)."""
        w = self.weight.get_value()
        if isinstance(w, BlockFP8):
            if ex is not None and ex.kernels == "pallas":
                kernel = partial(fp8_linear_pallas, platform=ex.platform)
                return fp8_linear_on_mesh(kernel, fp8_linear, param_mesh(self.weight), x, w.values, w.scales, w.block,
                                          self.weight.get_metadata()["axes"])
            return fp8_linear(x, w.values, w.scales, w.block)
        return linear(x, w, ex.weights_first_rows if ex is not None else 0)

    def matrix(self, dtype=None) -> jax.Array:
        """The weight (a BlockFP8 one dequantised: float32 product, then `dtype`, exactly what a
        dequantising load holds)."""
        w = self.weight.get_value()
        if isinstance(w, BlockFP8):
            return dequantize(w, dtype or jnp.float32)
        return w if dtype is None else w.astype(dtype)
