"""FP8 E4M3 block quantization as used by the release (spec §13).

A quantized weight `Wq` (float8_e4m3fn, [O, I]) comes with a float32 scale grid `S`
([ceil(O/bo), ceil(I/bi)], stored as `<module>.weight_scale_inv`). Dequantization MULTIPLIES:

    W[r, c] = float32(Wq[r, c]) * S[r // bo, c // bi]

Partial edge blocks (O or I not a multiple of the block) use their own scale entry.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)


def scale_grid_shape(shape, block=DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of the block-scale grid of a [O, I] matrix: (ceil(O/bo), ceil(I/bi))."""
    o, i = shape
    bo, bi = block
    return (-(-int(o) // int(bo)), -(-int(i) // int(bi)))


def _check_block(block) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"block must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def block_quant_fp8(w: np.ndarray, block=DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a [O, I] matrix per (bo, bi) block: scale = amax/448, Wq = fp8(W / scale).

    All-zero blocks get scale 1.0 (their Wq is all zeros, so they dequantize to 0 exactly).
    Returns (wq float8_e4m3fn [O, I], scale float32 [ceil(O/bo), ceil(I/bi)]).
    """
    bo, bi = _check_block(block)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"block_quant_fp8 expects a 2-D matrix, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("block_quant_fp8: matrix contains non-finite values")
    o, i = w.shape
    go, gi = scale_grid_shape(w.shape, (bo, bi))
    # pad to whole blocks with zeros (zeros never raise a block's amax)
    wp = np.zeros((go * bo, gi * bi), np.float32)
    wp[:o, :i] = w
    blocks = wp.reshape(go, bo, gi, bi)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = blocks / scale[:, None, :, None]
    np.clip(q, -FP8_MAX, FP8_MAX, out=q)  # guard against 448·(1+ε) after the division
    wq = q.reshape(go * bo, gi * bi)[:o, :i].astype(FP8_DTYPE)
    return np.ascontiguousarray(wq), scale


def expand_scale(scale: np.ndarray, shape, block=DEFAULT_BLOCK) -> np.ndarray:
    """The per-element scale of a [O, I] matrix (repeat each entry bo×bi, slice to shape)."""
    bo, bi = _check_block(block)
    o, i = shape
    s = np.asarray(scale, np.float32)
    return np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:o, :i]


def _check_scale(shape, scale_shape, block):
    want = scale_grid_shape(shape, block)
    if tuple(scale_shape) != want:
        raise ValueError(f"scale shape {tuple(scale_shape)} does not match the ceil grid {want} "
                         f"of a {tuple(shape)} matrix with block {tuple(block)}")


def block_dequant_fp8(wq: np.ndarray, scale: np.ndarray, block=DEFAULT_BLOCK) -> np.ndarray:
    """float32(Wq) × scale per block (multiply, despite the `_inv` name). Returns float32 [O, I]."""
    bo, bi = _check_block(block)
    wq = np.asarray(wq)
    if wq.ndim != 2:
        raise ValueError(f"block_dequant_fp8 expects a 2-D matrix, got shape {wq.shape}")
    _check_scale(wq.shape, np.shape(scale), (bo, bi))
    return wq.astype(np.float32) * expand_scale(scale, wq.shape, (bo, bi))


def block_dequant_fp8_jax(wq, scale, block=DEFAULT_BLOCK, dtype=None):
    """jax.numpy version of `block_dequant_fp8` (repeat the scale, slice, multiply).

    `dtype` is the output dtype (default float32); the product itself is formed in float32.
    Works under jit (shapes are static).
    """
    import jax.numpy as jnp

    bo, bi = _check_block(block)
    if wq.ndim != 2:
        raise ValueError(f"block_dequant_fp8_jax expects a 2-D matrix, got shape {wq.shape}")
    _check_scale(wq.shape, scale.shape, (bo, bi))
    o, i = wq.shape
    s = jnp.repeat(jnp.repeat(jnp.asarray(scale, jnp.float32), bo, axis=0), bi, axis=1)[:o, :i]
    out = wq.astype(jnp.float32) * s
    return out if dtype is None else out.astype(dtype)
