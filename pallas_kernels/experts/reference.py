"""Pure-XLA reference of the few-token routed experts: a loop over the experts in use.

A decode step of a few sequences routes its N·k assignments to at most N·k of the E experts (a
batch of 8 on the mid config: ~42 of 64). `experts_active_loop` (`lax.fori_loop` with a traced trip
count) visits only the experts some token picked, in id order, and runs each on all N tokens at
once in the weights-first orientation (`W [I,D] · xᵀ [D,N]`, XLA:CPU's fastest form for a few
columns). The native CPU kernel (`cpu_kernel.py`) computes the same values reading each used
expert once in place; XLA:CPU copies each expert's weights before its GEMMs (a dynamic slice).

Gradients: a `while` loop is not reverse-differentiable, so a custom VJP differentiates the same
computation written as a `scan` over all E positions of `order`, each skipped by `cond` past the
used count (`_active_loop(..., scanned=True)`).

Exactness: token n's output is the sum of its own experts' contributions in expert-id order
(other experts add an exact 0.0, `jnp.where`); its neighbours in the batch change only the
rounding of the GEMMs (float32 ulps: a 1-column product runs a matrix-vector kernel).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import precision
from pallas_kernels.swiglu import swiglu_act


def experts_active_loop(x, idx, wts, wg, wu, wd, limit):
    """Σ_j wts[n, j] · expert_{idx[n, j]}(x[n]) for every token, looping over the experts in use.

    x: [N,D]; idx: [N,k] int expert ids, ids outside [0, E) belong to no local expert (another
    device's, or masked) and contribute nothing; wts: [N,k] float32 routing weights (0 where an
    assignment should not count); wg, wu: [E,I,D]; wd: [E,D,I] float arrays in the checkpoint's
    `[out, in]` layout; limit: the SwiGLU clamp (0 = off). Returns [N,D] float32.
    """
    return _active(x, idx, wts, wg, wu, wd, limit)


def _active_loop(x, idx, wts, wg, wu, wd, limit, scanned: bool = False):
    N, D = x.shape
    E = wg.shape[0]
    prec = precision(x.dtype)
    ein = lambda spec, a, b: jnp.einsum(spec, a.astype(x.dtype), b, precision=prec,
                                        preferred_element_type=jnp.float32)
    valid = (idx >= 0) & (idx < E)
    safe = jnp.where(valid, idx, E)  # out of range: dropped by the scatters below
    used = jnp.zeros((E,), bool).at[safe.reshape(-1)].set(True, mode="drop")
    order = jnp.argsort(~used, stable=True).astype(jnp.int32)  # the used experts first, in id order
    # [N, E] weight of expert e for token n (0: not picked); a token picks an expert at most once
    rows = jnp.arange(N)[:, None]
    w_ne = jnp.zeros((N, E), jnp.float32).at[rows, safe].set(jnp.where(valid, wts, 0.0).astype(jnp.float32),
                                                              mode="drop")
    picked = jnp.zeros((N, E), bool).at[rows, safe].set(True, mode="drop")
    xt = x.T  # [D, N]: the tokens are the GEMMs' few columns

    def one_expert(j, out):
        e = order[j]
        g = ein("id,dn->in", wg[e], xt)
        u = ein("id,dn->in", wu[e], xt)
        h = swiglu_act(g, u, limit).astype(x.dtype)        # [I, N]
        y = ein("di,in->dn", wd[e], h)                      # [D, N]
        return out + jnp.where(picked[:, e][None, :], y * w_ne[:, e][None, :], 0.0)

    n_used = used.sum().astype(jnp.int32)
    out = jnp.zeros((D, N), jnp.float32)
    if scanned:
        step = lambda o, j: (jax.lax.cond(j < n_used, lambda o: one_expert(j, o), lambda o: o, o), None)
        return jax.lax.scan(step, out, jnp.arange(E, dtype=jnp.int32))[0].T
    return jax.lax.fori_loop(0, n_used, one_expert, out).T


@jax.custom_vjp
def _active(x, idx, wts, wg, wu, wd, limit):
    return _active_loop(x, idx, wts, wg, wu, wd, limit)


def _active_fwd(x, idx, wts, wg, wu, wd, limit):
    return _active_loop(x, idx, wts, wg, wu, wd, limit), (x, idx, wts, wg, wu, wd, limit)


def _active_bwd(res, ct):
    x, idx, wts, wg, wu, wd, limit = res
    _, vjp = jax.vjp(lambda x, wts, wg, wu, wd, limit: _active_loop(x, idx, wts, wg, wu, wd, limit, scanned=True),
                     x, wts, wg, wu, wd, limit)
    gx, gw, gg, gu, gd, gl = vjp(ct)
    return gx, None, gw, gg, gu, gd, gl


_active.defvjp(_active_fwd, _active_bwd)
