"""SwiGLU MLPs and the sigmoid-routed, group-limited MoE block (spec §7, §8).

Routed experts are stacked `[E, in, out]` so one grouped matmul (`jax.lax.ragged_dot` over tokens
sorted by expert) computes all of them with no Python loop over experts. For a handful of tokens
(decode) a gather of the selected experts' weights moves fewer bytes than the grouped matmul and is
used instead; both give the same result.

Expert parallelism (`experts_ep`): when `sharding.shard_model` / `sharding.load_sharded` attached
an `ep_plan` to the block (or `impl="ep"` runs under a context mesh), the routed experts run inside
`jax.shard_map`: every device computes its own experts (and its slice of their intermediate width)
for all tokens of its data shard and one `psum` over the `expert`/`model` axes combines them; no
expert weight ever leaves its device (design note: sharding/README.md). `FP8Experts` keeps routed
experts as float8_e4m3fn + float32 block scales and dequantises inside the expert matmuls (XLA;
the dense FP8 projections, `linear.FP8Linear`, can use the Pallas FP8 kernel).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.linear import Linear, init_normal
from ling_jax.ops import einsum, precision


class SwiGLULimit(nnx.Variable):
    """Per-layer clamp limit λ (0 = none). A variable, not a static attribute, so layers with
    different limits share one compiled body when the layer stack is scanned; not trained."""


def swiglu_act(gate: jax.Array, up: jax.Array, limit) -> jax.Array:
    """`min(SiLU(gate), λ) · clip(up, −λ, λ)`; plain SwiGLU when λ = 0 (spec §7.2)."""
    a = jax.nn.silu(gate.astype(jnp.float32))
    u = up.astype(jnp.float32)
    if isinstance(limit, nnx.Variable):
        limit = limit[...]
    if isinstance(limit, (int, float)):
        if limit:
            a, u = jnp.minimum(a, limit), jnp.clip(u, -limit, limit)
    else:  # traced per-layer limit: 0 means no clamp
        on = limit > 0
        a = jnp.where(on, jnp.minimum(a, limit), a)
        u = jnp.where(on, jnp.clip(u, -limit, limit), u)
    return (a * u).astype(gate.dtype)


class SwiGLU(nnx.Module):
    """Dense FFN and the shared expert: `down(act(gate(x), up(x)))`."""

    def __init__(self, d: int, inter: int, *, dtype, rngs: nnx.Rngs, limit: float | None = None):
        self.gate_proj = Linear(d, inter, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, inter, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, d, dtype=dtype, rngs=rngs)
        self.limit = SwiGLULimit(jnp.asarray(limit, jnp.float32)) if limit is not None else None

    def __call__(self, x, impl: str | None = None):
        """impl: kernel implementation of FP8-kept projections (`FP8Linear`), see ling_jax/linear.py."""
        h = swiglu_act(self.gate_proj(x, impl), self.up_proj(x, impl), 0.0 if self.limit is None else self.limit[...])
        return self.down_proj(h, impl)


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


def grouped_matmul_tiled(xs: jax.Array, w: jax.Array, sizes: jax.Array, tile: int | None = None) -> jax.Array:
    """`ragged_dot(xs, w, sizes)` as a scan over (row tile, expert) work items.

    xs: [M,K] rows sorted by group; w: [G,K,N]; sizes: [G] rows per group (sum = M). XLA:CPU lowers
    ragged_dot to a dense product against every group (G× the work); here each work item multiplies
    one `tile`-row slice by one group's weight, and there are at most ceil(M/tile) + G items, so the
    work is ~(1 + G·tile/M)× the ideal. Rows outside the item's group are masked.
    """
    M, K = xs.shape
    G, _, N = w.shape
    if tile is None:  # ~M/G rows per group: tiles of that size keep the G partial tiles cheap
        tile = int(min(128, max(8, 1 << max(0, (M // max(G, 1)).bit_length() - 1))))
    n_tiles = -(-M // tile)
    items = n_tiles + G
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    last = jnp.maximum(ends - 1, starts) // tile
    span = jnp.where(sizes > 0, last - first + 1, 0)
    cum = jnp.cumsum(span) - span
    item_group = jnp.repeat(jnp.arange(G), span, total_repeat_length=items)
    pos = jnp.arange(items)
    valid = pos < span.sum()
    item_tile = jnp.clip(first[item_group] + pos - cum[item_group], 0, n_tiles - 1)
    pad = n_tiles * tile - M
    xp = jnp.pad(xs, ((0, pad), (0, 0)))
    prec = precision(xs.dtype)

    def body(out, it):
        g, t, ok = it
        rows = jax.lax.dynamic_slice_in_dim(xp, t * tile, tile, 0)
        y = jnp.dot(rows, w[g].astype(xs.dtype), precision=prec, preferred_element_type=jnp.float32)
        r = t * tile + jnp.arange(tile)
        mask = ok & (r >= starts[g]) & (r < ends[g])
        cur = jax.lax.dynamic_slice_in_dim(out, t * tile, tile, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, cur + jnp.where(mask[:, None], y, 0.0), t * tile, 0), None

    out, _ = jax.lax.scan(body, jnp.zeros((n_tiles * tile, N), jnp.float32), (item_group, item_tile, valid))
    return out[:M].astype(xs.dtype)


def capacity_levels(M: int, G: int) -> tuple[int, ...]:
    """Static per-group row capacity tried by `grouped_matmul_capacity`: the power of two ≥ twice the
    mean group size (at least 8), if below M. One level: each extra level is another compiled copy
    of the expert matmuls in every MoE layer, and for balanced routing one suffices."""
    c = max(8, 1 << max(0, -(-2 * M // max(G, 1)) - 1).bit_length())
    return (c,) if c < M else ()


def grouped_matmul_capacity(xs: jax.Array, w: jax.Array, sizes: jax.Array, capacity: int) -> jax.Array:
    """`ragged_dot(xs, w, sizes)` as one batched matmul over groups padded to `capacity` rows.

    xs: [M,K] rows sorted by group; w: [G,K,N]; sizes: [G] (sum ≤ M; rows past the sum come out 0).
    Exact only when every group has ≤ capacity rows (the caller checks). Why: a batched matmul
    [G,C,K]×[G,K,N] reads every weight once, in place, with large dense inner products, where the
    tiled scan copies a weight slice per work item.
    """
    M, K = xs.shape
    G = w.shape[0]
    ends = jnp.cumsum(sizes)
    r = jnp.arange(M)
    grp = jnp.minimum(jnp.searchsorted(ends, r, side="right"), G - 1)
    rank = r - (ends - sizes)[grp]
    rank = jnp.where(r < ends[-1], rank, capacity)  # rows in no group: dropped below, read back as 0
    buf = jnp.zeros((G, capacity, K), xs.dtype).at[grp, rank].set(xs, mode="drop")
    y = jnp.einsum("gck,gkn->gcn", buf, w.astype(xs.dtype), precision=precision(xs.dtype),
                   preferred_element_type=jnp.float32)
    return y.at[grp, rank].get(mode="fill", fill_value=0).astype(xs.dtype)


def grouped_matmul_cpu(xs: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """Exact grouped matmul for XLA:CPU: the capacity level when it holds the largest group
    (`grouped_matmul_capacity`, ~2× the useful FLOPs as dense batched GEMMs), else the tiled scan.
    `lax.switch` runs only the chosen branch, so skewed routing costs time, never correctness."""
    levels = capacity_levels(xs.shape[0], w.shape[0])
    if not levels:
        return grouped_matmul_tiled(xs, w, sizes)
    need = jnp.max(sizes)
    branch = jnp.sum(need > jnp.asarray(levels))  # index of the first level ≥ need; len(levels) = tiled
    fns = [lambda a, b, c, cap=cap: grouped_matmul_capacity(a, b, c, cap) for cap in levels]
    return jax.lax.switch(branch, fns + [grouped_matmul_tiled], xs, w, sizes)


def grouped_matmul(xs, w, sizes):
    """Grouped expert matmul: `jax.lax.ragged_dot` (a native grouped GEMM on TPU/GPU), or on CPU,
    where ragged_dot is computed densely against every group, `grouped_matmul_cpu`."""
    if jax.default_backend() == "cpu":
        return grouped_matmul_cpu(xs, w, sizes)
    return jax.lax.ragged_dot(xs, w.astype(xs.dtype), sizes, precision=precision(xs.dtype)).astype(xs.dtype)


def experts_grouped(x, idx, wg, wu, wd, limit):
    """All routed experts via one sort + a grouped matmul per projection.

    x: [N,D]; idx: [N,k]; wg, wu: [E,D,I]; wd: [E,I,D]. Returns per-assignment outputs [N,k,D].
    """
    N, k = idx.shape
    E = wg.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    dot = lambda a, w: grouped_matmul(a, w, sizes)
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


class FP8Experts(nnx.Module):
    """Routed experts kept in float8_e4m3fn with float32 scales (`--keep-fp8`), dequantised per matmul.

    gate/up: [E,D,I] fp8 with scales [E, ceil(D/bi), I]; down: [E,I,D] fp8 with scales [E, I, ceil(D/bo)]
    ((bo, bi) = the checkpoint's weight_block_size over its [out, in] matrices). The scale grid keeps
    the checkpoint's 128-blocks along D but is expanded along I, so the `model` mesh axis can split I
    at any divisor (1280 / 4 = 320 is not a multiple of 128); this costs 4/128 = 3% extra bytes.
    """

    def __init__(self, cfg: LingConfig):
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.block_out, self.block_in = (int(b) for b in cfg.weight_block_size)
        f8 = jnp.float8_e4m3fn
        gi, go = -(-D // self.block_in), -(-D // self.block_out)
        self.gate_proj = nnx.Param(jnp.zeros((E, D, I), f8))
        self.up_proj = nnx.Param(jnp.zeros((E, D, I), f8))
        self.down_proj = nnx.Param(jnp.zeros((E, I, D), f8))
        self.gate_proj_scale = nnx.Param(jnp.ones((E, gi, I), jnp.float32))
        self.up_proj_scale = nnx.Param(jnp.ones((E, gi, I), jnp.float32))
        self.down_proj_scale = nnx.Param(jnp.ones((E, I, go), jnp.float32))

    def weights(self):
        return (self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                self.gate_proj_scale[...], self.up_proj_scale[...], self.down_proj_scale[...])


def dequant_in(wq, s, block: int, dtype):
    """[..., D, I] fp8 × scale [..., ceil(D/block), I] → dtype (product formed in float32)."""
    D = wq.shape[-2]
    return (wq.astype(jnp.float32) * jnp.repeat(s, block, axis=-2)[..., :D, :]).astype(dtype)


def dequant_out(wq, s, block: int, dtype):
    """[..., I, D] fp8 × scale [..., I, ceil(D/block)] → dtype (product formed in float32)."""
    D = wq.shape[-1]
    return (wq.astype(jnp.float32) * jnp.repeat(s, block, axis=-1)[..., :D]).astype(dtype)


def experts_local(x, idx, wts, e0, weights, limit, impl: str, blocks=None):
    """Weighted sum over the assignments that fall on experts `e0 .. e0+E_l-1` (the ones in `weights`).

    x: [N,D]; idx: [N,k] global expert ids; wts: [N,k] f32; weights: (wg, wu, wd) stacked [E_l,D,I_l],
    [E_l,D,I_l], [E_l,I_l,D], plus (sg, su, sd) scales when `blocks=(block_in, block_out)` (FP8).
    Assignments to other experts contribute 0. Returns [N,D] float32 (a partial sum when the experts
    or their intermediate width are split over devices).
    """
    N, k = idx.shape
    wg, wu, wd = weights[:3]
    E_l = wg.shape[0]
    loc = idx - e0
    mine = (loc >= 0) & (loc < E_l)
    dt = x.dtype

    def deq(w, s, fn, block):
        return w.astype(dt) if blocks is None else fn(w, s, block, dt)

    if impl == "gather":
        li = jnp.where(mine, loc, 0)
        sc = (None,) * 3 if blocks is None else tuple(s[li] for s in weights[3:])
        g = einsum("nd,nkdi->nki", x, deq(wg[li], sc[0], dequant_in, blocks and blocks[0]))
        u = einsum("nd,nkdi->nki", x, deq(wu[li], sc[1], dequant_in, blocks and blocks[0]))
        h = swiglu_act(g, u, limit)
        y = einsum("nki,nkid->nkd", h, deq(wd[li], sc[2], dequant_out, blocks and blocks[1]))
    else:
        flat = jnp.where(mine, loc, E_l).reshape(-1)  # other devices' assignments sort last, in no group
        order = jnp.argsort(flat, stable=True)
        xs = x[order // k]
        sizes = jnp.bincount(flat, length=E_l).astype(jnp.int32)
        sc = (None,) * 3 if blocks is None else weights[3:]
        dot = lambda a, w: grouped_matmul(a, w, sizes)  # rows past sum(sizes) (other devices') come out 0
        h = swiglu_act(dot(xs, deq(wg, sc[0], dequant_in, blocks and blocks[0])),
                       dot(xs, deq(wu, sc[1], dequant_in, blocks and blocks[0])), limit)
        ys = dot(h, deq(wd, sc[2], dequant_out, blocks and blocks[1]))
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(N, k, -1)
    y = jnp.where(mine[..., None], y, 0)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), jnp.where(mine, wts, 0.0),
                      precision=jax.lax.Precision.HIGHEST)


def experts_ep(x, idx, wts, weights, limit, plan, impl: str, blocks=None):
    """Expert-parallel routed experts: `experts_local` per device inside `jax.shard_map`, then psum.

    plan: an `EPPlan` (sharding/rules.py) holding the mesh and the PartitionSpecs the expert weights
    were placed with. Tokens are split over `data` when N divides evenly (else every data row
    computes all tokens). Returns [N,D] float32, identical on every device of a data row.
    """
    from jax.sharding import PartitionSpec as P

    mesh = plan.mesh
    N = x.shape[0]
    n_data = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("data", 1)
    tok = "data" if n_data > 1 and N % n_data == 0 else None
    e_ax = plan.specs[0][0]
    sum_axes = tuple(a for a in (e_ax, plan.specs[0][2]) if a is not None)

    def body(x, idx, wts, limit, *ws):
        e0 = jax.lax.axis_index(e_ax) * ws[0].shape[0] if e_ax is not None else 0
        y = experts_local(x, idx, wts, e0, ws, limit, impl, blocks)
        return jax.lax.psum(y, sum_axes) if sum_axes else y

    tp = P(tok, None)
    lim = jnp.asarray(limit, jnp.float32)  # may be traced (per-layer SwiGLULimit): an explicit replicated input
    # check_vma=False: the inner kernels (e.g. the tiled grouped matmul's scan) start carries from
    # fresh zeros, which the varying-manual-axes type check would reject; psum makes the output
    # replicated over expert/model, as out_specs states.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tp, tp, tp, P()) + tuple(plan.specs[:len(weights)]), out_specs=tp,
                       check_vma=False)
    return fn(x, idx, wts, lim, *weights)


class MoE(nnx.Module):
    ep_plan = None  # set by sharding.shard_model / load_sharded: selects the expert-parallel path

    def __init__(self, cfg: LingConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        routed_limit, shared_limit = cfg.swiglu_limits(layer)
        self.routed_limit = SwiGLULimit(jnp.asarray(routed_limit, jnp.float32))
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared_experts = (SwiGLU(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts,
                                      dtype=dtype, rngs=rngs, limit=shared_limit)
                               if cfg.num_shared_experts else None)

    def __call__(self, x, forced_idx=None, impl: str = "auto", kernel_impl: str | None = None):
        """x: [B,T,D] → (y [B,T,D], expert ids [B,T,k]). `forced_idx` pins the routing decisions.

        impl: routed-expert path ("auto" | "gather" | "grouped" | "ep"). kernel_impl: "xla" | "pallas" |
        None for the shared expert's FP8-kept projections. FP8 routed experts (`FP8Experts`) always
        dequantise in XLA inside `experts_local`: the grouped path is a ragged matmul over tokens sorted
        by expert, for which there is no FP8-scale kernel (`fp8_linear_pallas` is a dense-linear kernel).
        """
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
        fp8 = isinstance(ex, FP8Experts)
        plan = self.ep_plan
        if impl == "ep" and plan is None:
            from sharding.rules import context_ep_plan  # the mesh set with jax.set_mesh / sharding.use_mesh
            plan = context_ep_plan(self.cfg, fp8)
        inner = impl if impl in ("gather", "grouped") else (
            # gather copies each assignment's expert weights before reading them (3 passes per
            # assignment); the grouped path reads each expert once: gather wins while 3·N·k ≤ E.
            "gather" if 3 * B * T * idx.shape[1] <= self.cfg.num_experts else "grouped")
        if plan is not None or fp8:
            weights = ex.weights() if fp8 else (ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...])
            blocks = (ex.block_in, ex.block_out) if fp8 else None
            if plan is not None:
                y = experts_ep(xf, idx, wts, weights, self.routed_limit[...], plan, inner, blocks)
            else:
                y = experts_local(xf, idx, wts, 0, weights, self.routed_limit[...], inner, blocks)
            y = y.astype(x.dtype)
        else:
            fn = experts_gathered if inner == "gather" else experts_grouped
            y = fn(xf, idx, ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...], self.routed_limit[...])
            y = jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), wts,
                           precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf, kernel_impl)
        return y.reshape(B, T, D), idx.reshape(B, T, -1)
