"""Bias-free linear layers holding their weight in the checkpoint's `[out, in]` layout.

`Linear` holds a float weight. `FP8Linear` (`--keep-fp8`) holds what an FP8 checkpoint stores: the
float8_e4m3fn weight `[out, in]` plus its float32 block-scale grid `weight_scale_inv`
`[ceil(out/bo), ceil(in/bi)]` (multiplied, despite the checkpoint's `_inv` name; spec §13), and
dequantises inside the matmul: `impl="pallas"` runs `pallas_kernels.fp8_matmul.fp8_linear_pallas`
(interpret mode on CPU), `impl="xla"` its twin `fp8_linear_xla`. A model holds either kind per
matrix, as the checkpoint stores it (`sharding.load.abstract_model`). Both take `(x, impl)` and
give `matrix(dtype)` for code that needs the weight itself (MLA's absorbed `kv_b_proj`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.ops import linear


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

    def __call__(self, x: jax.Array, impl: str | None = None) -> jax.Array:
        """`x @ weight.T` in x's dtype (`impl` is accepted for symmetry with FP8Linear; unused)."""
        return linear(x, self.weight[...])

    def matrix(self, dtype=None) -> jax.Array:
        w = self.weight[...]
        return w if dtype is None else w.astype(dtype)


class FP8Linear(nnx.Module):
    """Linear kept as stored by an FP8 checkpoint: float8_e4m3fn weight + float32 block scales."""

    def __init__(self, in_features: int, out_features: int, block=(128, 128)):
        self.block = (int(block[0]), int(block[1]))  # static: (rows, cols) of one scale block
        grid = (-(-out_features // self.block[0]), -(-in_features // self.block[1]))
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.float8_e4m3fn))
        self.weight_scale_inv = nnx.Param(jnp.ones(grid, jnp.float32))

    def __call__(self, x: jax.Array, impl: str | None = None) -> jax.Array:
        """`x @ dequant(weight, scale).T` in x's dtype; the dequantised weight is never stored.
        impl: "pallas" | "xla" | None (per-backend default, see `pallas_kernels.default_impl`)."""
        import pallas_kernels as pk
        return pk.fp8_linear(impl, x, self.weight[...], self.weight_scale_inv[...], self.block)

    def matrix(self, dtype=None) -> jax.Array:
        """The dequantised weight (float32 product, then `dtype`), exactly what a dequantising load holds."""
        from ling_jax.checkpoint.fp8 import block_dequant_fp8_jax
        return block_dequant_fp8_jax(self.weight[...], self.weight_scale_inv[...], self.block, dtype)
