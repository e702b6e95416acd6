"""Kimi Delta Attention (spec §9): short convs, bounded gate, and the gated delta rule.

Two equivalent paths over the same state `[batch, heads, key=128, value=128]` (float32):
`kda_chunk_scan` (prefill: `lax.scan` over chunks, WY form of §9.7) and `kda_recurrent_step`
(decode, §9.6). Padding is handled by giving pad tokens `g = 0` (no decay) and `beta = 0` (no
write): the state passes through them unchanged, so padding never leaks into it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.linear import Linear
from ling_jax.norms import gated_rms_norm, l2_normalize
import pallas_kernels as pk

_HI = jax.lax.Precision.HIGHEST


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


def kda_recurrent_step(state, q, k, v, g, beta):
    """One token of the gated delta rule (spec §9.6), all float32.

    state [B,H,dk,dv]; q (normalised and scaled), k (normalised) [B,H,dk]; v [B,H,dv]; g [B,H,dk]
    log-decay; beta [B,H]. Returns (o [B,H,dv], new state). Read-out uses the updated state.
    """
    s = state * jnp.exp(g)[..., None]
    err = v - jnp.einsum("bhkv,bhk->bhv", s, k, precision=_HI)
    s = s + (beta[..., None] * k)[..., None] * err[:, :, None, :]
    o = jnp.einsum("bhkv,bhk->bhv", s, q, precision=_HI)
    return o, s


def kda_recurrent_scan(q, k, v, g, beta, state, return_all_states: bool = False):
    """Token-by-token scan of `kda_recurrent_step` (decode, short verify chunks, test ground truth).

    q, k, g: [B,T,H,dk]; v: [B,T,H,dv]; beta: [B,T,H]; state [B,H,dk,dv].
    Returns (o [B,T,H,dv], final state[, states after every token [B,T,H,dk,dv]]).
    """
    def step(s, xs):
        o, s = kda_recurrent_step(s, *xs)
        return s, (o, s) if return_all_states else o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    s, out = jax.lax.scan(step, state, xs)
    if return_all_states:
        o, states = out
        return jnp.moveaxis(o, 0, 1), s, jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(out, 0, 1), s


def _chunk_step(s0, xs):
    """One chunk of the WY-form recurrence (spec §9.7). Shapes per (batch, head): [C, d]."""
    q, k, v, g, beta = xs  # [B,H,C,dk], [B,H,C,dk], [B,H,C,dv], [B,H,C,dk], [B,H,C]
    C = q.shape[2]
    gam = jnp.cumsum(g, axis=2)  # Γ_r
    # Pairwise decays exp(Γ_r − Γ_s) for s ≤ r, computed directly so no exp(−Γ) can overflow.
    diff = gam[:, :, :, None, :] - gam[:, :, None, :, :]  # [B,H,C(r),C(s),dk]
    causal = jnp.tril(jnp.ones((C, C), bool))
    dec = jnp.where(causal[:, :, None], jnp.exp(jnp.where(causal[:, :, None], diff, 0.0)), 0.0)
    kk = jnp.einsum("bhrd,bhsd,bhrsd->bhrs", k, k, dec, precision=_HI)
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    lmat = jnp.where(strict, kk * beta[..., :, None], 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    tm = jax.scipy.linalg.solve_triangular(eye + lmat, jnp.broadcast_to(eye * beta[..., None, :], lmat.shape),
                                           lower=True, unit_diagonal=True)
    eg = jnp.exp(gam)
    w = jnp.einsum("bhrs,bhsd->bhrd", tm, eg * k, precision=_HI)
    u = jnp.einsum("bhrs,bhsd->bhrd", tm, v, precision=_HI)
    vt = u - jnp.einsum("bhrd,bhdv->bhrv", w, s0, precision=_HI)
    a = jnp.einsum("bhrd,bhsd,bhrsd->bhrs", q, k, dec, precision=_HI)
    o = jnp.einsum("bhrd,bhdv->bhrv", q * eg, s0, precision=_HI) + jnp.einsum("bhrs,bhsv->bhrv", a, vt, precision=_HI)
    last = gam[:, :, -1:, :]  # Γ_C
    s1 = s0 * jnp.exp(last)[:, :, 0, :, None] + jnp.einsum("bhrd,bhrv->bhdv", jnp.exp(last - gam) * k, vt,
                                                          precision=_HI)
    return s1, o


def default_chunk_size() -> int:
    """KDA prefill chunk: 16 tokens on CPU, 64 on TPU/GPU. Why: the exact intra-chunk form builds a
    [C, C, dk] decay tensor per head (work ∝ T·C·dk) and a C×C triangular solve; on XLA:CPU chunk 16
    made mid-config prefill 1.3-1.7× faster than 64 (tools/bench_generate.py), while accelerators
    want the larger matmuls of C = 64."""
    return 16 if jax.default_backend() == "cpu" else 64


def kda_chunk_scan(q, k, v, g, beta, state, chunk_size: int = 64):
    """Chunked KDA: `lax.scan` over chunks of `chunk_size` tokens (exactly `kda_recurrent_scan`).

    q, k, g: [B,T,H,dk]; v: [B,T,H,dv]; beta: [B,T,H]; state: [B,H,dk,dv] f32.
    The tail is padded with g=0, beta=0, k=q=0, which leaves the state untouched.
    Returns (o [B,T,H,dv] f32, final state).
    """
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    C = max(1, min(chunk_size, T))
    n = -(-T // C)
    pad = n * C - T

    def prep(a):
        a = a.astype(jnp.float32)
        if pad:
            a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((B, n, C) + a.shape[2:])  # [B,n,C,H,...]
        perm = (1, 0, 3, 2) + tuple(range(4, a.ndim))
        return jnp.transpose(a, perm)  # [n,B,H,C,...]

    xs = tuple(prep(a) for a in (q, k, v, g, beta))
    s, o = jax.lax.scan(_chunk_step, state.astype(jnp.float32), xs)  # o: [n,B,H,C,dv]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, n * C, H, dv)[:, :T]
    return o, s


class KimiDeltaAttention(nnx.Module):
    """KDA attention block: projections → short convs → gate/beta/L2 → delta rule → gated norm → o_proj."""

    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs):
        D, H, d, K = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
        P = H * d
        self.cfg = cfg
        for name in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):  # [H*dk, D]
            setattr(self, name, Linear(D, P, axes=("heads", "embed"), dtype=dtype, rngs=rngs))
        self.b_proj = Linear(D, H, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(P, D, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            taps = jax.random.normal(rngs.params(), (P, K), jnp.float32) / K
            # checkpoint [P,1,K] squeezed to [P,K]
            setattr(self, name, nnx.Param(taps.astype(dtype), axes=("heads", "conv")))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (H,), jnp.float32, 1.0, 16.0)),
                               axes=("heads",))
        self.dt_bias = nnx.Param(jnp.zeros((P,), jnp.float32), axes=("heads",))
        self.o_norm = nnx.Param(jnp.ones((d,), dtype), axes=("head_dim",))  # gated RMSNorm weight shared by heads

    def __call__(self, x, state: KDAState, n_valid, *, mode: str = "chunk", chunk_size: int | None = None,
                 return_all_states: bool = False, impl: str | None = None):
        """x: [B,T,D]; n_valid: [B] real tokens per row (right padding after). mode: chunk|recurrent;
        chunk_size: None = `default_chunk_size()` for this backend.
        impl: "xla" | "pallas" | None (default per backend; see pallas_kernels.default_impl): the KDA
        kernels and, for projections kept FP8 (`FP8Linear`), the FP8 matmul.

        Returns (out [B,T,D], new KDAState[, rollback info]). With return_all_states the third value is
        (recurrent states after every token [B,T,H,dk,dv], (q, k, v) raw conv inputs [B,K-1+T,P]) so
        a speculative verify can roll back to any accepted prefix (`kda_rollback`).
        """
        cfg = self.cfg
        B, T, _ = x.shape
        H, d = cfg.num_attention_heads, cfg.head_dim
        valid = jnp.arange(T)[None, :] < n_valid[:, None]  # [B,T]
        convs = [short_conv(getattr(self, f"{n}_proj")(x, impl), getattr(self, f"{n}_conv1d")[...],
                            getattr(state, f"conv_{n}"), n_valid, return_cat=return_all_states) for n in "qkv"]
        (q, cq), (k, ck), (v, cv) = [c[:2] for c in convs]
        q = l2_normalize(q.reshape(B, T, H, d)) * (d ** -0.5)
        k = l2_normalize(k.reshape(B, T, H, d))
        v = v.reshape(B, T, H, d).astype(jnp.float32)
        g = kda_gate(self.f_proj(x, impl).reshape(B, T, H, d), self.A_log[...], self.dt_bias[...],
                     cfg.kda_lower_bound)
        beta = jax.nn.sigmoid(self.b_proj(x, impl).astype(jnp.float32))
        g = jnp.where(valid[..., None, None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
        if x.dtype == jnp.bfloat16:  # the chunked reference kernel stores normalised q/k in bf16
            q, k = q.astype(jnp.bfloat16).astype(jnp.float32), k.astype(jnp.bfloat16).astype(jnp.float32)
        all_states = None
        if return_all_states:
            o, s, all_states = kda_recurrent_scan(q, k, v, g, beta, state.recurrent, return_all_states=True)
        elif mode == "recurrent":
            o, s = pk.kda_recurrent_scan(impl, q, k, v, g, beta, state.recurrent)
        else:
            o, s = pk.kda_chunk_scan(impl, q, k, v, g, beta, state.recurrent, chunk_size or default_chunk_size())
        o = o.astype(x.dtype)
        gate = self.g_proj(x, impl).reshape(B, T, H, d)
        y = gated_rms_norm(o, gate, self.o_norm[...], cfg.rms_norm_eps).astype(x.dtype)
        out = self.o_proj(y.reshape(B, T, H * d), impl)
        new = KDAState(s, cq, ck, cv)
        if return_all_states:
            return out, new, (all_states, tuple(c[2] for c in convs))
        return out, new


def kda_rollback(old: KDAState, rollback, n_keep: jax.Array) -> KDAState:
    """The KDA cache after only the first n_keep[b] of a verify chunk's tokens (0 = unchanged)."""
    all_states, cats = rollback
    K = cats[0].shape[1] - all_states.shape[1] + 1
    idx = jnp.maximum(n_keep - 1, 0)
    picked = jnp.take_along_axis(all_states, idx[:, None, None, None, None], axis=1)[:, 0]
    rec = jnp.where((n_keep > 0)[:, None, None, None], picked, old.recurrent)
    return KDAState(rec, *(conv_state_at(c, n_keep, K) for c in cats))
