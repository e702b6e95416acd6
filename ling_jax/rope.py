"""Interleaved rotary embedding with optional YaRN (spec §10.2, §10.3).

Rotation pairs are adjacent channels (2i, 2i+1) in stored order; q_pe and the cached k_pe use the
same layout, so dot products equal the reference's de-interleaved form exactly.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import LingConfig


def _yarn_mscale(s: float, mu: float) -> float:
    return 1.0 if s <= 1 else 0.1 * mu * math.log(s) + 1.0


def rope_parameters(cfg: LingConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [rope_dim/2] float64, attention_factor) for the config, YaRN included."""
    d = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    inv_extra = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_extra, 1.0
    s = rs.factor
    inv_inter = inv_extra / s

    def corr_dim(r):
        return d * math.log(rs.original_max_position_embeddings / (2 * math.pi * r)) / (2 * math.log(base))

    lo, hi = corr_dim(rs.beta_fast), corr_dim(rs.beta_slow)
    if rs.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
    omega = 1.0 - ramp
    inv_freq = inv_inter * (1 - omega) + inv_extra * omega
    if rs.attention_factor is not None:
        af = rs.attention_factor
    elif rs.mscale and rs.mscale_all_dim:
        af = _yarn_mscale(s, rs.mscale) / _yarn_mscale(s, rs.mscale_all_dim)
    else:
        af = _yarn_mscale(s, 1.0)
    return inv_freq, af


def context_limit(cfg: LingConfig) -> int:
    """The most positions a run may use beyond max_position_embeddings (`--allow-long-context`):
    under YaRN the scaled length factor × original_max_position_embeddings (1,048,576 for factor 4
    over 262,144), never less than max_position_embeddings; without rope scaling, MAX_ROPE_POSITION
    (where the exact angles end). Capped at MAX_ROPE_POSITION either way."""
    rs = cfg.rope_scaling
    if rs is None:
        return MAX_ROPE_POSITION
    scaled = int(math.floor(rs.factor * rs.original_max_position_embeddings))
    return min(max(scaled, cfg.max_position_embeddings), MAX_ROPE_POSITION)


def softmax_scale(cfg: LingConfig) -> float:
    """1/√qk_head_dim, times mscale(mscale_all_dim)² under YaRN (spec §10.3)."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        scale *= _yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


#: Rotary angles are exact (float32 rounding of the reduced angle) for positions below this: 2^21,
#: twice the 1,048,576 positions of a factor-4 YaRN over 262,144. Positions are int32 everywhere.
MAX_ROPE_POSITION = 1 << 21
#: position = hi · 2^ANGLE_SPLIT_BITS + lo, each part's angle read from a float64-made table
ANGLE_SPLIT_BITS = 10


@functools.lru_cache(maxsize=16)
def angle_tables(inv_freq: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(hi [MAX_ROPE_POSITION >> ANGLE_SPLIT_BITS, d/2], lo [2^ANGLE_SPLIT_BITS, d/2]) float32:
    (k·2^ANGLE_SPLIT_BITS·inv_freq) mod 2π and (j·inv_freq) mod 2π, evaluated in float64 on host.

    Why: a float32 product position × inv_freq carries the float32 rounding of inv_freq times the
    position, ~0.06 rad at 10^6 for the highest frequency. The angle mod 2π is all cos/sin need;
    summing the two reduced parts (each rounded once to float32, both < 2π) gives the angle to a few
    float32 ulps of 4π (~1e-6 rad) at any position below MAX_ROPE_POSITION.
    """
    f = np.asarray(inv_freq, np.float64)
    two_pi = 2 * np.pi
    hi = np.arange(MAX_ROPE_POSITION >> ANGLE_SPLIT_BITS, dtype=np.float64)[:, None] * (1 << ANGLE_SPLIT_BITS)
    lo = np.arange(1 << ANGLE_SPLIT_BITS, dtype=np.float64)[:, None]
    # k·2^s·f in float64 is exact to ~2^-52 relative: ≤ 2^21·f·1e-16 ≈ 2e-10 rad before the reduction
    return (np.mod(hi * f, two_pi).astype(np.float32), np.mod(lo * f, two_pi).astype(np.float32))


def rope_angles(positions: jax.Array, inv_freq) -> jax.Array:
    """Rotary angles [..., d/2] float32 in [0, 4π) of int positions [...] (< MAX_ROPE_POSITION),
    congruent mod 2π to position × inv_freq evaluated exactly (see `angle_tables`)."""
    hi, lo = angle_tables(tuple(float(v) for v in np.asarray(inv_freq, np.float64)))
    p = jnp.clip(positions.astype(jnp.int32), 0, MAX_ROPE_POSITION - 1)
    return jnp.take(jnp.asarray(hi), p >> ANGLE_SPLIT_BITS, axis=0) + jnp.take(
        jnp.asarray(lo), p & ((1 << ANGLE_SPLIT_BITS) - 1), axis=0)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, attention_factor: float) -> jax.Array:
    """Rotate adjacent pairs of the last axis.

    x: [batch, time, ..., rope_dim]; positions: [batch, time] int (int32: exact at any position;
    never a float, bfloat16 is wrong from 257 on). Angles from `rope_angles` (exact mod 2π to float32
    rounding of the reduced angle, not of the product); cos/sin are computed in float32 and cast to
    x's dtype before use, as the reference does.
    """
    ang = rope_angles(positions, inv_freq)  # [B,T,d/2]
    cos = (jnp.cos(ang) * attention_factor).astype(x.dtype)
    sin = (jnp.sin(ang) * attention_factor).astype(x.dtype)
    cos, sin = (c.reshape(c.shape[:2] + (1,) * (x.ndim - 3) + c.shape[2:]) for c in (cos, sin))  # over heads
    xp = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    a, b = xp[..., 0], xp[..., 1]
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.reshape(x.shape)
