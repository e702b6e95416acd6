"""Pure-XLA reference of the absorbed-MLA core (spec §10.6): what `mla.kernel` must equal.

`latent_attention` is multi-query attention over the latent cache (keys `[c ; k_pe]`, values `c`)
under `attention_mask`; the model (`ling_jax.mla`) calls it, or the Pallas kernel, from its absorbed
form, and uses `attention_mask` / `masked_softmax` in its expanded form too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import einsum


def attention_mask(q_pos: jax.Array, key_len: int, kv_valid_len: jax.Array) -> jax.Array:
    """[B,T,S] bool: key τ visible to query at absolute position p iff τ ≤ p and τ < kv_valid_len."""
    kpos = jnp.arange(key_len)[None, None, :]
    return (kpos <= q_pos[:, :, None]) & (kpos < kv_valid_len[:, None, None])


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax over the last axis of `scores` restricted to `mask` (same shape, bool); a row with no
    visible key gives zeros, not NaN (a padded query row)."""
    s = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)


def latent_attention(q_hat, q_pe, c, k_pe, mask, scale):
    """The absorbed core (reference of the Pallas kernel `latent_attention_pallas`): MQA over the latent cache.

    q_hat [B,T,H,r] (query through W_UK); q_pe [B,T,H,dr]; c [B,S,r]; k_pe [B,S,dr]; mask [B,T,S].
    Returns c_hat [B,T,H,r] = softmax((q_hat·c + q_pe·k_pe)·scale) @ c, in q_hat's dtype.
    """
    s = (einsum("bthr,bsr->bhts", q_hat, c, dtype=jnp.float32)
         + einsum("bthd,bsd->bhts", q_pe, k_pe, dtype=jnp.float32)) * scale
    p = masked_softmax(s, mask[:, None]).astype(q_hat.dtype)
    return einsum("bhts,bsr->bthr", p, c)
