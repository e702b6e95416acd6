"""Pure-XLA reference of the KDA recurrence (spec §9.6, §9.7): what the Pallas kernels must equal.

Two equivalent paths over the same state `[batch, heads, key, value]` (float32), all float32:
`kda_recurrent_step` / `kda_recurrent_scan` (one token at a time, the ground truth; decode and
speculative verify) and `kda_chunk_scan` (prefill: `lax.scan` over chunks in the WY form of §9.7).
Inputs are *prepared* as the model makes them (q L2-normalised and scaled, k normalised, g the
bounded log-decay, beta the sigmoid). Padding is handled by giving pad tokens `g = 0` (no decay)
and `beta = 0` (no write): the state passes through them unchanged, so padding never leaks into it.
The model (`ling_jax.kda`) runs these on XLA and `kda/chunk_kernel.py`, `kda/step_kernel.py` on Pallas.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


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


def kda_recurrent_scan(q, k, v, g, beta, state, return_all_states: bool = False, step_fn=kda_recurrent_step):
    """Token-by-token scan of `kda_recurrent_step` (decode, short verify chunks, test ground truth).

    q, k, g: [B,T,H,dk]; v: [B,T,H,dv]; beta: [B,T,H]; state [B,H,dk,dv].
    Returns (o [B,T,H,dv], final state[, states after every token [B,T,H,dk,dv]]).
    step_fn: the one-token step (the Pallas step kernel scans through here too).
    """
    def step(s, xs):
        o, s = step_fn(s, *xs)
        return s, (o, s) if return_all_states else o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    s, out = jax.lax.scan(step, state, xs)
    if return_all_states:
        o, states = out
        return jnp.moveaxis(o, 0, 1), s, jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(out, 0, 1), s


# exp(−Γ) is formed only while it cannot overflow: Γ ≥ C · gate_floor ≥ −FACTOR_MAX_EXP.
FACTOR_MAX_EXP = 80.0


def factorable(chunk: int, gate_floor: float | None) -> bool:
    """Whether a chunk of `chunk` tokens whose log-decays are all ≥ gate_floor may form its pairwise
    decays as exp(Γ_r)·exp(−Γ_s) (exp(−Γ_s) ≤ e^80 < 3.4e38, the float32 maximum)."""
    return gate_floor is not None and -gate_floor * chunk <= FACTOR_MAX_EXP


def _chunk_step(s0, xs, gate_floor: float | None = None):
    """One chunk of the WY-form recurrence (spec §9.7). Shapes per (batch, head): [C, d].

    gate_floor: a lower bound of every g (the model's bounded gate: `kda_lower_bound`), or None.
    The intra-chunk products Σ_d a_r,d b_s,d exp(Γ_r,d − Γ_s,d) (s ≤ r) are then two plain matmuls
    of (a·e^Γ) and (b·e^−Γ) when `factorable` (same sums, each term rounded alike); otherwise the
    pairwise decays are materialised as [C, C, dk] and nothing evaluates exp(−Γ). Why: on XLA:CPU
    the [B, H, C, C, dk] decay tensor and its three-operand products were a fifth of an 8-row
    prefill step of the mid config."""
    q, k, v, g, beta = xs  # [B,H,C,dk], [B,H,C,dk], [B,H,C,dv], [B,H,C,dk], [B,H,C]
    C = q.shape[2]
    gam = jnp.cumsum(g, axis=2)  # Γ_r
    causal = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    eg = jnp.exp(gam)
    qe = q * eg  # q_r e^{Γ_r}: the read-out of s0 and, factored, the left side of a
    if factorable(C, gate_floor):
        kd = k * jnp.exp(-gam)  # k_s e^{−Γ_s}
        kk = jnp.einsum("bhrd,bhsd->bhrs", eg * k, kd, precision=_HI)
        a = jnp.where(causal, jnp.einsum("bhrd,bhsd->bhrs", qe, kd, precision=_HI), 0.0)
    else:  # pairwise decays exp(Γ_r − Γ_s) for s ≤ r, computed directly so no exp(−Γ) can overflow
        diff = gam[:, :, :, None, :] - gam[:, :, None, :, :]  # [B,H,C(r),C(s),dk]
        dec = jnp.where(causal[:, :, None], jnp.exp(jnp.where(causal[:, :, None], diff, 0.0)), 0.0)
        kk = jnp.einsum("bhrd,bhsd,bhrsd->bhrs", k, k, dec, precision=_HI)
        a = jnp.einsum("bhrd,bhsd,bhrsd->bhrs", q, k, dec, precision=_HI)
    lmat = jnp.where(strict, kk * beta[..., :, None], 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    tm = jax.scipy.linalg.solve_triangular(eye + lmat, jnp.broadcast_to(eye * beta[..., None, :], lmat.shape),
                                           lower=True, unit_diagonal=True)
    w = jnp.einsum("bhrs,bhsd->bhrd", tm, eg * k, precision=_HI)
    u = jnp.einsum("bhrs,bhsd->bhrd", tm, v, precision=_HI)
    vt = u - jnp.einsum("bhrd,bhdv->bhrv", w, s0, precision=_HI)
    o = jnp.einsum("bhrd,bhdv->bhrv", qe, s0, precision=_HI) + jnp.einsum("bhrs,bhsv->bhrv", a, vt, precision=_HI)
    last = gam[:, :, -1:, :]  # Γ_C
    s1 = s0 * jnp.exp(last)[:, :, 0, :, None] + jnp.einsum("bhrd,bhrv->bhdv", jnp.exp(last - gam) * k, vt,
                                                          precision=_HI)
    return s1, o


def kda_chunk_scan(q, k, v, g, beta, state, chunk_size: int = 64, return_chunk_states: bool = False,
                   gate_floor: float | None = None):
    """Chunked KDA: `lax.scan` over chunks of `chunk_size` tokens (exactly `kda_recurrent_scan`).

    q, k, g: [B,T,H,dk]; v: [B,T,H,dv]; beta: [B,T,H]; state: [B,H,dk,dv] f32.
    The tail is padded with g=0, beta=0, k=q=0, which leaves the state untouched.
    Returns (o [B,T,H,dv] f32, final state[, the state after every chunk [B, ceil(T/C), H,dk,dv]
    with C = min(chunk_size, T)]). Why the chunk states: the scan passes through them anyway, and
    they are the prefix cache's snapshots inside a prefill chunk (`ling_jax.kda`, serve/snapshots.py).
    gate_floor: a lower bound of g, when the caller has one (`_chunk_step`: the factored form).
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
    chunk_step = partial(_chunk_step, gate_floor=gate_floor)
    if return_chunk_states:
        def step(s0, x):
            s1, o = chunk_step(s0, x)
            return s1, (o, s1)

        s, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), xs)  # states: [n,B,H,dk,dv]
    else:
        s, o = jax.lax.scan(chunk_step, state.astype(jnp.float32), xs)  # o: [n,B,H,C,dv]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, n * C, H, dv)[:, :T]
    if return_chunk_states:
        return o, s, jnp.moveaxis(states, 0, 1)
    return o, s
