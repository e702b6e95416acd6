"""Pallas kernel for one KDA decode token (spec §9.6); reference: `kda.reference.kda_recurrent_step`.

Fused decay → delta-rule error → rank-1 write → read-out for a batch, one pass over the state.
The state is input 0 and output 1 of the pallas_call with `input_output_aliases={0: 1}`: under a
jit that donates the state (or inside a larger jit whose state buffer is dead afterwards) the
update is written in place, so a decode step moves exactly 2 × 4 MiB of state per layer and
sequence and never allocates a second state buffer.

Layout: q, k, g are passed as columns [B,H,dk,1] and v as rows [B,H,1,dv] (free reshapes), so the
kernel needs only broadcasts and sublane reductions — no matmul, no transpose:
    s = S ⊙ e^g;  e = v − Σ_d k_d s_d;  S' = s + β k eᵀ;  o = Σ_d q_d S'_d.
Grid `(batch, head-block, value-block)`; every program owns `block_h` heads × `block_v` value
columns (the value columns of the delta rule are independent).

`kda_recurrent_scan_pallas` runs it token by token over a `[B,T,...]` input (decode, T = 1, is a
single kernel call), as `kda.reference.kda_recurrent_scan` does with the XLA step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import compiler_params, target
from pallas_kernels.kda.reference import kda_recurrent_scan

F32 = jnp.float32


def _kernel(s_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s_out_ref):
    s = s_ref[...].astype(F32) * jnp.exp(g_ref[...].astype(F32))  # [hb,dk,bv] · [hb,dk,1]
    k = k_ref[...].astype(F32)
    err = v_ref[...].astype(F32) - jnp.sum(k * s, axis=1, keepdims=True)  # [hb,1,bv]
    s = s + (beta_ref[...].astype(F32) * k) * err
    o_ref[...] = jnp.sum(q_ref[...].astype(F32) * s, axis=1, keepdims=True).astype(o_ref.dtype)
    s_out_ref[...] = s.astype(s_out_ref.dtype)


def _defaults(block_h, block_v, H, dv, plat: str):
    if block_h is None:
        block_h = 1 if plat == "gpu" else next(h for h in (8, 4, 2, 1) if H % h == 0)
    if block_v is None:
        block_v = min(dv, 64) if plat == "gpu" else dv
    return block_h, block_v


@functools.partial(jax.jit, static_argnames=("plat", "interpret", "block_h", "block_v"))
def _run(state, q, k, v, g, beta, interpret, block_h, block_v, plat):
    B, H, dk, dv = state.shape
    hb, bv = block_h, block_v
    if H % hb or dv % bv:
        raise ValueError(f"block_h {hb} must divide H {H} and block_v {bv} must divide dv {dv}")
    col = lambda a: a.reshape(B, H, dk, 1)  # noqa: E731
    col_spec = pl.BlockSpec((None, hb, dk, 1), lambda b, h, j: (b, h, 0, 0))
    row_spec = pl.BlockSpec((None, hb, 1, bv), lambda b, h, j: (b, h, 0, j))
    st_spec = pl.BlockSpec((None, hb, dk, bv), lambda b, h, j: (b, h, 0, j))
    o, s = pl.pallas_call(
        _kernel,
        grid=(B, H // hb, dv // bv),
        in_specs=[st_spec, col_spec, col_spec, row_spec, col_spec,
                  pl.BlockSpec((None, hb, 1, 1), lambda b, h, j: (b, h, 0, 0))],
        out_specs=[row_spec, st_spec],
        out_shape=[jax.ShapeDtypeStruct((B, H, 1, dv), F32), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={0: 1},
        compiler_params=compiler_params(interpret, plat, ("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="kda_recurrent_step",
    )(state, col(q), col(k), v.reshape(B, H, 1, dv), col(g), beta.reshape(B, H, 1, 1))
    return o.reshape(B, H, dv), s


def kda_recurrent_step_pallas(state, q, k, v, g, beta, interpret=None, *, block_h: int | None = None,
                              block_v: int | None = None, platform: str | None = None):
    """One KDA token for a batch (same arguments and result as `kda.reference.kda_recurrent_step`).

    state [B,H,dk,dv] f32 (updated in place when donated); q (normalised, scaled), k (normalised),
    g (log-decay) [B,H,dk]; v [B,H,dv]; beta [B,H]. Returns (o [B,H,dv] f32, new state).
    block_h heads per program (default 8 on TPU, 1 on GPU); block_v value columns (default dv; 64 on GPU).
    platform: the target backend (`_common.backend_platform`; None = the default one).
    """
    plat, interpret = target(platform, interpret)
    block_h, block_v = _defaults(block_h, block_v, state.shape[1], state.shape[3], plat)
    return _run(state, q, k, v, g, beta, interpret, block_h, block_v, plat=plat)


def kda_recurrent_scan_pallas(q, k, v, g, beta, state, *, platform: str | None = None, **kernel_kw):
    """Token-by-token KDA with the step kernel (same arguments and result as
    `kda.reference.kda_recurrent_scan` without `return_all_states`).

    q, k, g: [B,T,H,dk]; v: [B,T,H,dv]; beta: [B,T,H]; state [B,H,dk,dv] f32. Returns
    (o [B,T,H,dv] f32, final state). T = 1 (decode) is one kernel call; longer inputs a `lax.scan`
    of it. Per-token states (speculative verify) come from the reference scan: it has to
    materialise every state anyway, which is what its scan already does. kernel_kw: see
    `kda_recurrent_step_pallas`; platform: as there (one target for every step).
    """
    step = functools.partial(kda_recurrent_step_pallas, platform=platform, **kernel_kw)
    if q.shape[1] == 1:
        o, s = step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
        return o[:, None], s
    return kda_recurrent_scan(q, k, v, g, beta, state, step_fn=step)
