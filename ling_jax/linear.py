"""Bias-free linear layer holding its weight in the checkpoint's `[out, in]` layout.

<<<<<<< HEAD
The weight is a float array or, when a checkpoint's FP8 matrix is kept quantised, a `BlockFP8`
(float8_e4m3fn values + float32 block scales, `ling_jax.quantized`): one class, dispatching on what
the weight is. A BlockFP8 weight is dequantised inside the matmul: `ex.kernels == "pallas"` runs
the Pallas FP8 kernel (interpret mode on CPU), "xla" its pure-XLA reference. `matrix(dtype)` gives
the (dequantised) weight itself for code that needs it (MLA's absorbed `kv_b_proj`).
=======
`Linear` holds a float weight. `FP8Linear` (`--keep-fp8`) holds what an FP8 checkpoint stores: the
float8_e4m3fn weight `[out, in]` plus its float32 block-scale grid `weight_scale_inv`
`[ceil(out/bo), ceil(in/bi)]` (multiplied, despite the checkpoint's `_inv` name; spec §13), and
dequantises inside the matmul: `impl="pallas"` runs `pallas_kernels.fp8.kernel.fp8_linear_pallas`
(interpret mode on CPU), anything else its reference `pallas_kernels.fp8.reference.fp8_linear`.
A model holds either kind per matrix, as the checkpoint stores it (`sharding.load.abstract_model`).
Both take `(x, impl)` and give `matrix(dtype)` for code that needs the weight itself (MLA's
absorbed `kv_b_proj`).
>>>>>>> kernels
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk
from ling_jax.exec_config import ExecConfig
from ling_jax.ops import linear
<<<<<<< HEAD
from ling_jax.quantized import BlockFP8, dequantize
=======
from pallas_kernels.fp8.kernel import fp8_linear_pallas
from pallas_kernels.fp8.reference import block_dequant_fp8_jax, fp8_linear
>>>>>>> kernels


def init_normal(rngs: nnx.Rngs, shape, dtype, fan_in: int | None = None):
    """N(0, 1/fan_in): keeps activations O(1) in randomly initialised models."""
    fan_in = fan_in or shape[-1]
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (out_features, in_features), dtype))

    def __call__(self, x: jax.Array, ex: ExecConfig | None = None) -> jax.Array:
        """`x @ weight.T` in x's dtype; a BlockFP8 weight is dequantised inside the matmul by the
        kernel `ex.kernels` selects (the dequantised weight is never stored)."""
        w = self.weight.get_value()
        if isinstance(w, BlockFP8):
            matmul = fp8_linear_pallas if ex is not None and ex.kernels == "pallas" else fp8_linear
            return matmul(x, w.values, w.scales, w.block)
        return linear(x, w)

    def matrix(self, dtype=None) -> jax.Array:
        """The weight (a BlockFP8 one dequantised: float32 product, then `dtype`, exactly what a
        dequantising load holds)."""
        w = self.weight.get_value()
        if isinstance(w, BlockFP8):
            return dequantize(w, dtype or jnp.float32)
        return w if dtype is None else w.astype(dtype)
<<<<<<< HEAD
=======


class FP8Linear(nnx.Module):
    """Linear kept as stored by an FP8 checkpoint: float8_e4m3fn weight + float32 block scales."""

    def __init__(self, in_features: int, out_features: int, block=(128, 128)):
        self.block = (int(block[0]), int(block[1]))  # static: (rows, cols) of one scale block
        grid = (-(-out_features // self.block[0]), -(-in_features // self.block[1]))
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.float8_e4m3fn))
        self.weight_scale_inv = nnx.Param(jnp.ones(grid, jnp.float32))

    def __call__(self, x: jax.Array, impl: str | None = None) -> jax.Array:
        """`x @ dequant(weight, scale).T` in x's dtype; the dequantised weight is never stored.
        impl: "pallas" runs the Pallas kernel; anything else (None, "auto", "xla") the XLA reference."""
        matmul = fp8_linear_pallas if impl == "pallas" else fp8_linear
        return matmul(x, self.weight[...], self.weight_scale_inv[...], self.block)

    def matrix(self, dtype=None) -> jax.Array:
        """The dequantised weight (float32 product, then `dtype`), exactly what a dequantising load holds."""
        return block_dequant_fp8_jax(self.weight[...], self.weight_scale_inv[...], self.block, dtype)
>>>>>>> kernels
