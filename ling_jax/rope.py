"""Interleaved rotary embedding with optional YaRN (spec §10.2, §10.3).

Rotation pairs are adjacent channels (2i, 2i+1) in stored order; q_pe and the cached k_pe use the
same layout, so dot products equal the reference's de-interleaved form exactly.
"""
from __future__ import annotations

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


def softmax_scale(cfg: LingConfig) -> float:
    """1/√qk_head_dim, times mscale(mscale_all_dim)² under YaRN (spec §10.3)."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        scale *= _yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, attention_factor: float) -> jax.Array:
    """Rotate adjacent pairs of the last axis.

    x: [batch, time, ..., rope_dim]; positions: [batch, time] int. cos/sin are computed in float32
    and cast to x's dtype before use, as the reference does.
    """
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B,T,d/2]
    cos = (jnp.cos(ang) * attention_factor).astype(x.dtype)
    sin = (jnp.sin(ang) * attention_factor).astype(x.dtype)
    cos, sin = (c.reshape(c.shape[:2] + (1,) * (x.ndim - 3) + c.shape[2:]) for c in (cos, sin))  # over heads
    xp = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    a, b = xp[..., 0], xp[..., 1]
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.reshape(x.shape)
