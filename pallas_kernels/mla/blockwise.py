"""Blockwise (online-softmax) XLA forms of MLA attention: the dense forms' twins that never hold more
than one key block of scores.

Why: the dense forms (`reference.latent_attention`, `ling_jax.mla.mla_expanded_attention`) build
the score tensor [B,H,T,S] and a [B,T,S] mask in float32; a 32K-token prompt on the release config
would need 256 GiB of scores per MLA layer. Here the keys are visited in blocks of `block` with a
running max m, running sum l and a float32 accumulator (flash attention), so the temporaries are
[B,H,T,block] whatever S is. Masking is computed per block from positions instead of a materialised
mask: key τ is visible to the query at absolute position p of sequence b iff τ ≤ p and τ < kv_len[b]
(exactly `reference.attention_mask`).

The loop is a `lax.fori_loop` with a static trip count ceil(S / block) (reverse-differentiable) whose
body is a `lax.cond` that skips every block at or beyond the largest visible key of the batch, so a
prefill chunk early in a long cache costs the keys it sees, not the cache's length. The last block
is read at a clamped start (S need not be a multiple of block: no padded copy of the cache) and its
keys already visited by the previous block are masked out.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import einsum, linear

F32 = jnp.float32
NEG = -1e30  # a finite "minus infinity": exp(NEG - m) underflows to 0 and no NaN appears on empty rows


def visible_limit(q_pos: jax.Array, kv_len: jax.Array) -> jax.Array:
    """[B,T] int32: query (b, t) sees keys τ < limit[b, t] = min(q_pos[b, t] + 1, kv_len[b])."""
    return jnp.minimum(q_pos + 1, kv_len[:, None]).astype(jnp.int32)


def _online_update(carry, s, visible, values: Callable[[jax.Array], jax.Array]):
    """One key block of the online softmax. s [B,H,T,bk] float32 scaled scores; visible [B,1,T,bk]
    bool; values(p [B,H,T,bk]) -> [B,H,T,d] float32 (the block's p @ V). carry = (m, l [B,H,T],
    acc [B,H,T,d]) float32."""
    m, l, acc = carry
    s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc + values(p)
    return m_new, l, acc


def blockwise_softmax_attention(key_block: Callable, n_keys: int, limit: jax.Array, block: int,
                                acc_shape: tuple) -> jax.Array:
    """softmax(scores) @ V over key blocks, masked by `limit` [B,T] (keys τ < limit[b,t] visible).

    key_block(start, bk) -> (s [B,H,T,bk] float32 scaled scores of keys start..start+bk-1,
    values(p [B,H,T,bk]) -> [B,H,T,d] float32): one function, so a block's keys are made once.
    acc_shape = (B,H,T,d).
    Returns [B,H,T,d] float32; rows that see no key give zeros (as `reference.masked_softmax`).
    """
    bk = min(block, n_keys)
    n_blocks = -(-n_keys // bk)
    B, H, T, _ = acc_shape
    top = jnp.max(limit)  # no query sees a key at or beyond this

    def step(i, carry):
        start = i * bk
        read = jnp.minimum(start, n_keys - bk)  # the last block is read at a clamped start

        def update(carry):
            kpos = read + jnp.arange(bk, dtype=jnp.int32)
            visible = (kpos >= start) & (kpos < limit[:, :, None])  # [B,T,bk]; keys < start were visited
            s, values = key_block(read, bk)
            return _online_update(carry, s, visible[:, None], values)

        return jax.lax.cond(start < top, update, lambda c: c, carry)

    init = (jnp.full((B, H, T), NEG, F32), jnp.zeros((B, H, T), F32), jnp.zeros(acc_shape, F32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, step, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _key_block(x: jax.Array, start, bk: int) -> jax.Array:
    """x[:, start:start+bk] of a [B,S,...] array."""
    return jax.lax.dynamic_slice_in_dim(x, start, bk, axis=1)


def blockwise_latent_attention(q_hat, q_pe, c, k_pe, q_pos, kv_len, scale, block: int = 512):
    """The absorbed core over key blocks; equals `reference.latent_attention` under
    `attention_mask(q_pos, S, kv_len)`.

    q_hat [B,T,H,r]; q_pe [B,T,H,dr]; c [B,S,r]; k_pe [B,S,dr]; q_pos [B,T] int; kv_len [B] int.
    Returns c_hat [B,T,H,r] in q_hat's dtype. Scores [B,H,T,block] at most.
    """
    B, T, H, r = q_hat.shape
    S = c.shape[1]
    dt = q_hat.dtype

    def key_block(start, bk):
        cb, kb = _key_block(c, start, bk).astype(dt), _key_block(k_pe, start, bk).astype(q_pe.dtype)
        s = (einsum("bthr,bsr->bhts", q_hat, cb, dtype=F32) + einsum("bthd,bsd->bhts", q_pe, kb, dtype=F32)) * scale
        return s, lambda p: einsum("bhts,bsr->bhtr", p.astype(dt), cb, dtype=F32)

    o = blockwise_softmax_attention(key_block, S, visible_limit(q_pos, kv_len), block, (B, H, T, r))
    return o.transpose(0, 2, 1, 3).astype(dt)


def up_projection(w_kv_b) -> Callable:
    """The keys/values up-projection c [..., r] -> [..., H*(dn+dv)]: w_kv_b itself when it is a function
    (e.g. a kernel that reads the weight where it is stored), else `linear(c, w_kv_b)` of the matrix."""
    return w_kv_b if callable(w_kv_b) else (lambda c: linear(c, w_kv_b))


def blockwise_expanded_attention(q_nope, q_pe, c, k_pe, w_kv_b, q_pos, kv_len, scale, dtype, block: int = 512):
    """The expanded form over key blocks (each block's keys/values up-projected from its latents when
    visited); equals `ling_jax.mla.mla_expanded_attention` under `attention_mask(q_pos, S, kv_len)`.

    q_nope [B,T,H,dn]; q_pe [B,T,H,dr]; c [B,S,r]; k_pe [B,S,dr]; w_kv_b [H*(dn+dv), r], or the
    up-projection as a function (`up_projection`); q_pos [B,T] int; kv_len [B] int. Returns o
    [B,T,H,dv] in `dtype`.
    """
    B, T, H, dn = q_nope.shape
    S = c.shape[1]
    up = up_projection(w_kv_b)
    dv = jax.eval_shape(up, jax.ShapeDtypeStruct((1, c.shape[2]), c.dtype)).shape[-1] // H - dn

    def key_block(start, bk):
        kv = up(_key_block(c, start, bk)).reshape(B, bk, H, dn + dv)  # this block's keys/values
        s = (einsum("bthd,bshd->bhts", q_nope, kv[..., :dn], dtype=F32)
             + einsum("bthd,bsd->bhts", q_pe, _key_block(k_pe, start, bk), dtype=F32)) * scale
        return s, lambda p: einsum("bhts,bshd->bhtd", p.astype(dtype), kv[..., dn:], dtype=F32)

    o = blockwise_softmax_attention(key_block, S, visible_limit(q_pos, kv_len), block, (B, H, T, dv))
    return o.transpose(0, 2, 1, 3).astype(dtype)
