"""Pure-XLA reference of the FP8 block-scaled linear (spec §13): what `fp8.kernel` must equal.

`fp8_linear(x, wq, scale, block)` dequantises the whole weight (`block_dequant_fp8_jax`: float32
product of the float8_e4m3fn values and the repeated block scales, then x's dtype) and runs the
model's `linear`, so with `--keep-quantized` the XLA path computes exactly what a dequantising load does.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.fp8.blocks import DEFAULT_BLOCK, check_block, check_scale_grid
from pallas_kernels.matmul import linear


def block_dequant_fp8_jax(wq, scale, block=DEFAULT_BLOCK, dtype=None):
    """jax.numpy version of `ling_jax.checkpoint.fp8.block_dequant_fp8` (repeat the scale, slice, multiply).

    wq [..., O, I] float8_e4m3fn; scale [..., ceil(O/bo), ceil(I/bi)] (multiplied, despite the
    checkpoint's `_inv` name; a block side of 1 means one scale per row or column, as routed experts
    keep them). `dtype` is the output dtype (default float32); the product itself is formed in
    float32. Works under jit (shapes are static).
    """
    bo, bi = check_block(block)
    if wq.ndim < 2 or scale.ndim != wq.ndim or tuple(scale.shape[:-2]) != tuple(wq.shape[:-2]):
        raise ValueError(f"block_dequant_fp8_jax: weight {tuple(wq.shape)} and scale {tuple(scale.shape)} must be "
                         f"[..., O, I] and [..., ceil(O/bo), ceil(I/bi)] with the same leading dims")
    check_scale_grid(wq.shape[-2:], scale.shape[-2:], (bo, bi))
    o, i = wq.shape[-2:]
    s = jnp.asarray(scale, jnp.float32)
    if bo != 1:
        s = jnp.repeat(s, bo, axis=-2)[..., :o, :]
    if bi != 1:
        s = jnp.repeat(s, bi, axis=-1)[..., :i]
    out = wq.astype(jnp.float32) * s
    return out if dtype is None else out.astype(dtype)


def fp8_linear(x, wq, scale, block=DEFAULT_BLOCK):
    """x [..., K] @ dequant(wq [N,K] float8_e4m3fn, scale [⌈N/bn⌉,⌈K/bk⌉]).T → [..., N] in x's dtype.

    The weight is dequantised in float32, cast to x's dtype and multiplied by `linear`.
    """
    return linear(x, block_dequant_fp8_jax(wq, scale, block))
