"""Pure-XLA reference of the absorbed-MLA core (spec §10.6): what `mla.kernel` must equal.

`latent_attention` is multi-query attention over the latent cache (keys `[c ; k_pe]`, values `c`)
under `attention_mask`; the model (`ling_jax.mla`) calls it, or the Pallas kernel, from its absorbed
form, and uses `attention_mask` / `masked_softmax` in its expanded form too. `paged_latent_attention` is the same core
over a paged cache (`gather_pages` + `latent_attention`): the reference of `mla.paged.paged_latent_attention_pallas`,
which reads the pages where they lie.
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
    The T·H query rows are one matrix per sequence (row t·H + h; free reshapes): the products are then
    [T·H, r] x [r, S] and [T·H, S] x [S, r] GEMMs; XLA:CPU ran the 4-D `bhts,bsr->bthr` form of the
    second ~1.7x slower on a 64K-key decode (BENCHMARKS.md, long context, fifteenth session).
    """
    B, T, H, r = q_hat.shape
    S = c.shape[1]
    rows = lambda a: a.reshape(B, T * H, a.shape[-1])  # noqa: E731
    s = (einsum("bqr,bsr->bqs", rows(q_hat), c, dtype=jnp.float32)
         + einsum("bqd,bsd->bqs", rows(q_pe), k_pe, dtype=jnp.float32)) * scale
    p = masked_softmax(s.reshape(B, T, H, S), mask[:, :, None]).astype(q_hat.dtype)
    return einsum("bqs,bsr->bqr", p.reshape(B, T * H, S), c).reshape(B, T, H, r)


def gather_pages(pages: jax.Array, block_table: jax.Array, layer=None) -> jax.Array:
    """The pages of each sequence in order, a contiguous view: pages [n_pages, P, ...] (or, with `layer`
    (g, j), layer [g, j] of stacked pages [repeats, n, n_pages, P, ...], read by one gather, no slice of
    the pool); block_table [B, nb] int32. Returns [B, nb·P, ...]."""
    B, nb = block_table.shape
    got = pages[block_table] if layer is None else pages[layer[0], layer[1], block_table]
    return got.reshape((B, nb * got.shape[2]) + got.shape[3:])


def paged_latent_attention(q_hat, q_pe, c_pages, kpe_pages, block_table, kv_len, q_pos, scale, layer=None):
    """`latent_attention` over a paged latent cache (reference of `paged_latent_attention_pallas`).

    q_hat [B,T,H,r]; q_pe [B,T,H,dr]; c_pages [n_pages, P, r] and kpe_pages [n_pages, P, dr] (or stacked
    [repeats, n, n_pages, P, ...] with `layer` (g, j)); block_table [B, nb] int32 (key position p of row b
    at page block_table[b, p // P], offset p % P); kv_len [B]; q_pos [B,T]. Returns c_hat [B,T,H,r]. The
    gathered [B, nb·P, r] copy is what the kernel avoids."""
    c = gather_pages(c_pages, block_table, layer)
    k_pe = gather_pages(kpe_pages, block_table, layer)
    return latent_attention(q_hat, q_pe, c, k_pe, attention_mask(q_pos, c.shape[1], kv_len), scale)
