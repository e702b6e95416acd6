"""SwiGLU MLPs and the sigmoid-routed, group-limited MoE block (spec §7, §8).

Routed experts are stacked `[E, in, out]` so one grouped matmul (`jax.lax.ragged_dot` over tokens
sorted by expert) computes all of them with no Python loop over experts. For a handful of tokens
(decode) a gather of the selected experts' weights moves fewer bytes than the grouped matmul and is
used instead; both give the same result.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.linear import Linear, init_normal
from ling_jax.ops import einsum, linear, precision


def swiglu_act(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """`min(SiLU(gate), λ) · clip(up, −λ, λ)`; plain SwiGLU when λ = 0 (spec §7.2)."""
    a = jax.nn.silu(gate.astype(jnp.float32))
    u = up.astype(jnp.float32)
    if limit:
        a = jnp.minimum(a, limit)
        u = jnp.clip(u, -limit, limit)
    return (a * u).astype(gate.dtype)


class SwiGLU(nnx.Module):
    """Dense FFN and the shared expert: `down(act(gate(x), up(x)))`."""

    def __init__(self, d: int, inter: int, *, dtype, rngs: nnx.Rngs, limit: float = 0.0):
        self.gate_proj = Linear(d, inter, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, inter, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, d, dtype=dtype, rngs=rngs)
        self.limit = limit

    def __call__(self, x):
        h = swiglu_act(linear(x, self.gate_proj.weight[...]), linear(x, self.up_proj.weight[...]), self.limit)
        return linear(h, self.down_proj.weight[...])


def route(x: jax.Array, w: jax.Array, bias: jax.Array, cfg: LingConfig):
    """Grouped top-k routing in float32 (spec §8.1).

    x: [N,D]; w: [E,D]; bias: [E]. Returns (idx [N,k] int32, weights [N,k] f32). The bias steers
    selection only; weights are the unbiased sigmoid scores, renormalised and × routed_scaling_factor.
    """
    logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), w.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    sel = scores + bias.astype(jnp.float32)
    N, E = sel.shape
    G = cfg.n_group
    grouped = sel.reshape(N, G, E // G)
    group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N,G]
    _, keep = jax.lax.top_k(group_score, cfg.topk_group)
    group_mask = jnp.zeros((N, G), bool).at[jnp.arange(N)[:, None], keep].set(True)
    masked = jnp.where(jnp.repeat(group_mask, E // G, axis=1), sel, -jnp.inf)
    _, idx = jax.lax.top_k(masked, cfg.num_experts_per_tok)
    return idx, routing_weights(scores, idx, cfg)


def routing_weights(scores: jax.Array, idx: jax.Array, cfg: LingConfig) -> jax.Array:
    wts = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    return wts * cfg.routed_scaling_factor


def experts_grouped(x, idx, wg, wu, wd, limit):
    """All routed experts via one sort + `ragged_dot` per projection.

    x: [N,D]; idx: [N,k]; wg, wu: [E,D,I]; wd: [E,I,D]. Returns per-assignment outputs [N,k,D].
    """
    N, k = idx.shape
    E = wg.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    prec = precision(x.dtype)
    dot = lambda a, w: jax.lax.ragged_dot(a, w.astype(a.dtype), sizes, precision=prec).astype(a.dtype)
    h = swiglu_act(dot(xs, wg), dot(xs, wu), limit)
    ys = dot(h, wd)
    out = jnp.zeros_like(ys).at[order].set(ys)
    return out.reshape(N, k, -1)


def experts_gathered(x, idx, wg, wu, wd, limit):
    """Same result as `experts_grouped`, reading only the selected experts' weights (few tokens)."""
    g = einsum("nd,nkdi->nki", x, wg[idx].astype(x.dtype))
    u = einsum("nd,nkdi->nki", x, wu[idx].astype(x.dtype))
    h = swiglu_act(g, u, limit)
    return einsum("nki,nkid->nkd", h, wd[idx].astype(x.dtype))


class Router(nnx.Module):
    def __init__(self, cfg: LingConfig, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (cfg.num_experts, cfg.hidden_size), jnp.float32))
        self.expert_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32))


class Experts(nnx.Module):
    """Routed experts, stacked: gate/up [E,D,I], down [E,I,D] (checkpoint matrices transposed)."""

    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs):
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nnx.Param(init_normal(rngs, (E, D, I), dtype, fan_in=D))
        self.up_proj = nnx.Param(init_normal(rngs, (E, D, I), dtype, fan_in=D))
        self.down_proj = nnx.Param(init_normal(rngs, (E, I, D), dtype, fan_in=I))


class MoE(nnx.Module):
    def __init__(self, cfg: LingConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.routed_limit, shared_limit = cfg.swiglu_limits(layer)
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared_experts = (SwiGLU(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts,
                                      dtype=dtype, rngs=rngs, limit=shared_limit)
                               if cfg.num_shared_experts else None)

    def __call__(self, x, forced_idx=None, impl: str = "auto"):
        """x: [B,T,D] → (y [B,T,D], expert ids [B,T,k]). `forced_idx` pins the routing decisions."""
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        if forced_idx is None:
            idx, wts = route(xf, self.gate.weight[...], self.gate.expert_bias[...], self.cfg)
        else:
            idx = forced_idx.reshape(B * T, -1)
            logits = jnp.einsum("nd,ed->ne", xf.astype(jnp.float32), self.gate.weight[...].astype(jnp.float32),
                                precision=jax.lax.Precision.HIGHEST)
            wts = routing_weights(jax.nn.sigmoid(logits), idx, self.cfg)
        ex = self.experts
        if impl == "auto":
            impl = "gather" if B * T * idx.shape[1] <= self.cfg.num_experts else "grouped"
        fn = experts_gathered if impl == "gather" else experts_grouped
        y = fn(xf, idx, ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...], self.routed_limit)
        y = jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), wts, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf)
        return y.reshape(B, T, D), idx.reshape(B, T, -1)
