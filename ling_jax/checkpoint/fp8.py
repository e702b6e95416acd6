"""FP8 E4M3 block quantization as used by the release (spec §13).

A quantized weight `Wq` (float8_e4m3fn, [O, I]) comes with a float32 scale grid `S`
([ceil(O/bo), ceil(I/bi)], stored as `<module>.weight_scale_inv`). Dequantization MULTIPLIES:

    W[r, c] = float32(Wq[r, c]) * S[r // bo, c // bi]

Partial edge blocks (O or I not a multiple of the block) use their own scale entry. The jax
version of the dequantisation is `pallas_kernels.fp8.reference.block_dequant_fp8_jax`.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

# The grid convention (shape and checks) is shared with the jax references in pallas_kernels.fp8.
from pallas_kernels.fp8.blocks import DEFAULT_BLOCK, check_block, check_scale_grid, scale_grid_shape

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def block_quant_fp8(w: np.ndarray, block=DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a [O, I] matrix per (bo, bi) block: scale = amax/448, Wq = fp8(W / scale).

    All-zero blocks get scale 1.0 (their Wq is all zeros, so they dequantize to 0 exactly).
    Returns (wq float8_e4m3fn [O, I], scale float32 [ceil(O/bo), ceil(I/bi)]).
    """
    bo, bi = check_block(block)
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


def block_dequant_fp8(wq: np.ndarray, scale: np.ndarray, block=DEFAULT_BLOCK) -> np.ndarray:
    """float32(Wq) × scale per block (multiply, despite the `_inv` name). Returns float32 [O, I]."""
    bo, bi = check_block(block)
    wq = np.asarray(wq)
    if wq.ndim != 2:
        raise ValueError(f"block_dequant_fp8 expects a 2-D matrix, got shape {wq.shape}")
    check_scale_grid(wq.shape, np.shape(scale), (bo, bi))
    s = np.repeat(np.repeat(np.asarray(scale, np.float32), bo, axis=0), bi, axis=1)  # per element, then sliced
    return wq.astype(np.float32) * s[:wq.shape[0], :wq.shape[1]]
