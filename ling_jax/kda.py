"""Kimi Delta Attention (spec §9): short convs, bounded gate, and the gated delta rule.

The delta rule itself runs over the state `[batch, heads, key=128, value=128]` (float32) in
`pallas_kernels.kda`: its XLA reference (`kda_chunk_scan` for prefill, `kda_recurrent_scan` /
`kda_recurrent_step` for decode) or the Pallas kernels. Padding is handled by giving pad tokens
`g = 0` (no decay) and `beta = 0` (no write): the state passes through them unchanged.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.exec_config import ExecConfig
from ling_jax.linear import Linear
from ling_jax.norms import gated_rms_norm, l2_normalize
from pallas_kernels.kda.chunk_kernel import kda_chunk_scan_pallas
from pallas_kernels.kda.reference import kda_chunk_scan, kda_recurrent_scan
from pallas_kernels.kda.step_kernel import kda_recurrent_scan_pallas


class KDAState(NamedTuple):
    """Per-layer KDA cache. recurrent: [B,H,dk,dv] f32; conv_*: [B,K-1,H*dk] raw pre-conv inputs."""
    recurrent: jax.Array
    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array


def kda_zero_state(cfg: LingConfig, batch: int, dtype) -> KDAState:
    H, d, K = cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
    conv = lambda: jnp.zeros((batch, K - 1, H * d), dtype)  # distinct buffers (they may be donated)
    return KDAState(jnp.zeros((batch, H, d, d), jnp.float32), conv(), conv(), conv())


def short_conv(u: jax.Array, taps: jax.Array, conv_state: jax.Array, n_valid: jax.Array, return_cat: bool = False):
    """Causal depthwise conv + SiLU over raw projections (spec §9.2).

    u: [B,T,C]; taps: [C,K] (tap K-1 multiplies the current token); conv_state: [B,K-1,C] (the
    previous K-1 raw inputs); n_valid: [B] number of real tokens (the rest are right padding).
    Returns (y [B,T,C], new conv_state holding the last K-1 *valid* raw inputs[, the concatenation
    [B,K-1+T,C] from which the state after any prefix can be sliced (speculative rollback)]).
    """
    K = taps.shape[1]
    T = u.shape[1]
    x = jnp.concatenate([conv_state.astype(u.dtype), u], axis=1)  # [B, K-1+T, C]
    acc = jnp.zeros(u.shape, jnp.float32)
    for j in range(K):
        acc = acc + x[:, j:j + T].astype(jnp.float32) * taps[:, j].astype(jnp.float32)
    y = jax.nn.silu(acc).astype(u.dtype)
    if return_cat:
        return y, conv_state_at(x, n_valid, K), x
    return y, conv_state_at(x, n_valid, K)


def conv_state_at(x_cat: jax.Array, n: jax.Array, K: int) -> jax.Array:
    """Conv state after the first n[b] new tokens: rows n..n+K-2 of [old state; new raw inputs]."""
    return jax.vmap(lambda xb, nb: jax.lax.dynamic_slice_in_dim(xb, nb, K - 1, axis=0))(x_cat, n)


def kda_gate(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array, lower_bound: float) -> jax.Array:
    """Bounded log-decay `L·σ(exp(A_log)·(f + dt_bias))` (spec §9.3). f: [B,T,H,dk] → f32, in (L, 0)."""
    f32 = f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(f.shape[-2:])
    return lower_bound * jax.nn.sigmoid(jnp.exp(A_log.astype(jnp.float32))[:, None] * f32)


def kda_rollback(old: KDAState, rollback, n_keep: jax.Array) -> KDAState:
    """The KDA cache after only the first n_keep[b] of a verify chunk's tokens (0 = unchanged)."""
    all_states, cats = rollback
    K = cats[0].shape[1] - all_states.shape[1] + 1
    idx = jnp.maximum(n_keep - 1, 0)
    picked = jnp.take_along_axis(all_states, idx[:, None, None, None, None], axis=1)[:, 0]
    rec = jnp.where((n_keep > 0)[:, None, None, None], picked, old.recurrent)
    return KDAState(rec, *(conv_state_at(c, n_keep, K) for c in cats))
