"""SwiGLU MLPs and the sigmoid-routed, group-limited MoE block (spec §7, §8).

Routed experts are stacked in the checkpoint's per-expert `[out, in]` layout (gate/up `[E, I, D]`,
down `[E, D, I]`) and computed with no Python loop over experts: on TPU/GPU one grouped matmul per
projection (`ragged_dot_general` over assignments sorted by expert), on CPU dense batched matmuls
over per-expert capacity buffers (`experts_capacity`). For a handful of tokens (decode) a gather of
the selected experts' weights moves fewer bytes and is used instead; all give the same result.

Expert parallelism (`experts_ep`): when `sharding.shard_model` / `sharding.load_sharded` attached
an `ep_plan` to the block (or `impl="ep"` runs under a context mesh), the routed experts run inside
`jax.shard_map`: every device computes its own experts (and its slice of their intermediate width)
for all tokens of its data shard and one `psum` over the `expert`/`model` axes combines them; no
expert weight ever leaves its device (design note: sharding/README.md). `FP8Experts` keeps routed
experts as float8_e4m3fn + float32 block scales and dequantises inside the expert matmuls (XLA;
the dense FP8 projections, `linear.FP8Linear`, can use the Pallas FP8 kernel).
"""
from __future__ import annotations

import functools

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
        self.gate_proj = Linear(d, inter, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, inter, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, d, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.limit = SwiGLULimit(jnp.asarray(limit, jnp.float32), axes=()) if limit is not None else None

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


def expert_ranks(flat: jax.Array, E: int):
    """Each assignment's rank among the assignments to the same expert (in assignment order).

    flat: [M] expert id per assignment; ids ≥ E belong to no expert (another device's). Returns
    (rank [M] int32, sizes [E] int32).
    """
    M = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # ids ≥ E are dropped
    starts = jnp.cumsum(sizes) - sizes
    sorted_rank = jnp.arange(M, dtype=jnp.int32) - starts[jnp.minimum(flat[order], E - 1)]
    return jnp.zeros((M,), jnp.int32).at[order].set(sorted_rank), sizes


def expert_capacity(N: int, k: int, E: int) -> int:
    """Rows per expert in the main pass of `experts_capacity`: 1.5× the mean load rounded up to a
    multiple of 8 (measured best on the mid config: 24 rows for 16 on average beat 16 and 32), but
    never more than N: a token picks an expert at most once, so N rows never spill."""
    c = 8 * max(1, -(-3 * N * k // (2 * E * 8)))
    return max(1, min(c, N))


def _expert_block(x, wg, wu, wd, buf, limit):
    """SwiGLU experts over per-expert row buffers: buf [E',C,D], wg/wu [E',I,D], wd [E',D,I] → [E',D,C].
    The token axis stays last (`eid,edc->eic`): XLA:CPU's batched GEMMs run 2-3× faster in this
    orientation than with tokens first, and `h` needs no transpose between the projections; the
    small buffer is transposed once to `[E',D,C]` (a further 2-7% on prefill than `eid,ecd->eic`)."""
    prec = precision(x.dtype)
    bt = jnp.swapaxes(buf, 1, 2)  # [E',D,C]
    g = jnp.einsum("eid,edc->eic", wg.astype(x.dtype), bt, precision=prec, preferred_element_type=jnp.float32)
    u = jnp.einsum("eid,edc->eic", wu.astype(x.dtype), bt, precision=prec, preferred_element_type=jnp.float32)
    h = swiglu_act(g, u, limit).astype(x.dtype)
    return jnp.einsum("edi,eic->edc", wd.astype(x.dtype), h, precision=prec, preferred_element_type=jnp.float32)


def experts_capacity(x, flat, k: int, wg, wu, wd, limit, capacity: int, spill: tuple[int, int] | None = None):
    """Routed experts as dense batched matmuls over per-expert buffers of `capacity` rows (XLA:CPU).

    x: [N,D]; flat: [N·k] expert id of each assignment (token = position // k; ids ≥ E: none; a
    token's k ids are distinct, as `route` gives them); wg, wu: [E,I,D]; wd: [E,D,I] (checkpoint
    `[out, in]` per expert). Returns [N·k, D] per-assignment
    outputs (0 for ids ≥ E). Why: XLA:CPU lowers ragged_dot densely (E× the work); a batched matmul
    over all experts reads each weight once, in place.

    Assignments past an expert's `capacity` (skewed routing) are spilled (`_spilled`): a `while` loop
    takes the `spill = (P, C2)` experts with the most rows left, gathers just their weights and runs
    them on their next C2 rows, until none is left (default P = E/16 in [1, 8], C2 = capacity/2 ≥ 8).
    A few overflowing experts then cost a few small matmuls, not another pass over all E. Skewed
    routing costs time, never correctness; gradients flow through both parts.
    """
    M = flat.shape[0]
    E = wg.shape[0]
    rank, sizes = expert_ranks(flat, E)
    out = _capacity_pass(x, flat, rank, k, wg, wu, wd, limit, capacity, 0)
    if capacity >= M // k:  # a token picks an expert at most once: ≤ N rows per expert, nothing spills
        return out
    P, C2 = spill or (max(1, min(8, E // 16)), max(8, capacity // 2))
    return out + _spilled(x, flat, rank, sizes, k, wg, wu, wd, limit, capacity, (min(P, E), C2))


def _capacity_pass(x, flat, rank, k, wg, wu, wd, limit, capacity, first):
    """Rows with rank in [first, first + capacity) of every expert, all experts at once → [M,D] (0 elsewhere)."""
    M = flat.shape[0]
    E, D = wg.shape[0], x.shape[-1]
    local = rank - first
    ok = (flat < E) & (local >= 0) & (local < capacity)
    e_of = jnp.where(ok, flat, 0)
    buf = jnp.zeros((E, capacity, D), x.dtype).at[e_of, jnp.where(ok, local, capacity)].set(
        x[jnp.arange(M) // k], mode="drop")
    y = _expert_block(x, wg, wu, wd, buf, limit)
    return jnp.where(ok[:, None], y[e_of, :, jnp.where(ok, local, 0)].astype(x.dtype), 0)


def _spill_loop(x, flat, rank, sizes, k, wg, wu, wd, limit, capacity, spill):
    """Outputs of the assignments ranked ≥ capacity (0 elsewhere), P experts × C2 rows per `while` round.
    rank, sizes: `expert_ranks(flat, E)`."""
    M = flat.shape[0]
    E, D = wg.shape[0], x.shape[-1]
    P, C2 = spill
    valid = flat < E
    e_of = jnp.where(valid, flat, 0)
    xa = x[jnp.arange(M) // k]

    def spill_round(carry):
        done, out = carry
        left = sizes - done
        _, sel = jax.lax.top_k(left, P)                                # [P] experts with the most rows left
        slot = jnp.full((E,), P, jnp.int32).at[sel].set(jnp.arange(P, dtype=jnp.int32))[e_of]
        local = rank - done[e_of]
        ok = valid & (slot < P) & (local >= 0) & (local < C2)
        buf = jnp.zeros((P, C2, D), x.dtype).at[jnp.where(ok, slot, P), jnp.where(ok, local, C2)].set(xa, mode="drop")
        y = _expert_block(x, wg[sel], wu[sel], wd[sel], buf, limit)  # [P, D, C2]
        out = jnp.where(ok[:, None], y[jnp.where(ok, slot, 0), :, jnp.where(ok, local, 0)].astype(x.dtype), out)
        return done.at[sel].add(jnp.minimum(left[sel], C2)), out

    done = jnp.minimum(sizes, capacity)
    init = (done, jnp.zeros((M, D), x.dtype))
    return jax.lax.while_loop(lambda c: jnp.any(sizes > c[0]), spill_round, init)[1]


def _spill_rounds(x, flat, rank, sizes, k, wg, wu, wd, limit, capacity):
    """Same values as `_spill_loop`, as a `scan` over the ⌈N/capacity⌉ − 1 possible further full
    passes (each skipped by `cond` when no expert reaches it): reverse-differentiable, unlike `while`."""
    N = flat.shape[0] // k
    most = jnp.max(sizes)

    def body(out, r):
        first = r * capacity
        run = lambda o: o + _capacity_pass(x, flat, rank, k, wg, wu, wd, limit, capacity, first)
        return jax.lax.cond(most > first, run, lambda o: o, out), None

    out = jnp.zeros((flat.shape[0], x.shape[-1]), x.dtype)
    return jax.lax.scan(body, out, jnp.arange(1, -(-N // capacity)))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 9, 10))
def _spilled(x, flat, rank, sizes, k, wg, wu, wd, limit, capacity, spill):
    return _spill_loop(x, flat, rank, sizes, k, wg, wu, wd, limit, capacity, spill)


def _spilled_fwd(x, flat, rank, sizes, k, wg, wu, wd, limit, capacity, spill):
    out = _spill_loop(x, flat, rank, sizes, k, wg, wu, wd, limit, capacity, spill)
    return out, (x, flat, rank, sizes, wg, wu, wd, limit)


def _spilled_bwd(k, capacity, spill, res, ct):
    x, flat, rank, sizes, wg, wu, wd, limit = res
    _, vjp = jax.vjp(lambda x, wg, wu, wd, limit: _spill_rounds(x, flat, rank, sizes, k, wg, wu, wd, limit, capacity),
                     x, wg, wu, wd, limit)
    gx, gg, gu, gd, gl = vjp(ct)
    return gx, None, None, None, gg, gu, gd, gl


_spilled.defvjp(_spilled_fwd, _spilled_bwd)


_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def experts_ragged(x, flat, k: int, wg, wu, wd, limit):
    """Same contract as `experts_capacity`, via one sort + `ragged_dot_general` per projection (a
    native grouped GEMM on TPU/GPU; weights `[E, out, in]` contracted on their last axis)."""
    M = flat.shape[0]
    E = wg.shape[0]
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # rows past sum(sizes) (ids ≥ E) come out 0

    def rd(a, w):
        return jax.lax.ragged_dot_general(a, w.astype(a.dtype), sizes, _RAGGED_DN, precision=precision(a.dtype),
                                          preferred_element_type=jnp.float32).astype(a.dtype)
    ys = rd(swiglu_act(rd(xs, wg), rd(xs, wu), limit), wd)
    return jnp.zeros((M, ys.shape[-1]), ys.dtype).at[order].set(ys)


def experts_grouped(x, idx, wg, wu, wd, limit):
    """All routed experts, each reading its weights once: x [N,D]; idx [N,k]; wg, wu [E,I,D];
    wd [E,D,I]. Returns per-assignment outputs [N,k,D]."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    if jax.default_backend() == "cpu":
        y = experts_capacity(x, flat, k, wg, wu, wd, limit, expert_capacity(N, k, wg.shape[0]))
    else:
        y = experts_ragged(x, flat, k, wg, wu, wd, limit)
    return y.reshape(N, k, -1)


def _gathered_token(xn, wg, wu, wd, limit):
    """One token's k experts: xn [D]; wg, wu [k,I,D]; wd [k,D,I] → [k,D]. The gate/up blocks are
    contracted as one `[k·I, D]` matrix-vector product (XLA:CPU's fastest form for them)."""
    k, I, D = wg.shape
    g = einsum("rd,d->r", wg.reshape(k * I, D).astype(xn.dtype), xn).reshape(k, I)
    u = einsum("rd,d->r", wu.reshape(k * I, D).astype(xn.dtype), xn).reshape(k, I)
    return einsum("kdi,ki->kd", wd.astype(xn.dtype), swiglu_act(g, u, limit))


def experts_gathered(x, idx, wg, wu, wd, limit, gathered: bool = False):
    """Same result as `experts_grouped`, reading only the selected experts' weights (few tokens).

    Tokens run one at a time (`lax.map`): per token the selected experts are gathered and read once;
    a batched product over several tokens' gathered weights ran 2-4× slower on XLA:CPU.
    `gathered=True`: wg/wu/wd are already `[N,k,...]` (the FP8 path dequantises after its gather).
    """
    if gathered:
        one = lambda a: _gathered_token(*a, limit)
        xs = (x, wg, wu, wd)
    else:
        one = lambda a: _gathered_token(a[0], wg[a[1]], wu[a[1]], wd[a[1]], limit)
        xs = (x, idx)
    if x.shape[0] == 1:  # batch-1 decode: no loop at all
        return one(tuple(a[0] for a in xs))[None]
    return jax.lax.map(one, xs)


class Router(nnx.Module):
    def __init__(self, cfg: LingConfig, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (cfg.num_experts, cfg.hidden_size), jnp.float32),
                                axes=("router", "embed"))
        self.expert_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32), axes=("router",))


class Experts(nnx.Module):
    """Routed experts, stacked in the checkpoint's per-expert `[out, in]` layout: gate/up [E,I,D],
    down [E,D,I] (the orientation XLA:CPU's batched matmuls read fastest, see `experts_capacity`).
    Each holds a float array or, kept quantised, a `BlockFP8` with block (1, bi) for gate/up and
    (bo, 1) for down (built by `ling_jax.loader`)."""

    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs):
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        gate_up, down = ("expert", "expert_mlp", "embed"), ("expert", "embed", "expert_mlp")
        self.gate_proj = nnx.Param(init_normal(rngs, (E, I, D), dtype, fan_in=D), axes=gate_up)
        self.up_proj = nnx.Param(init_normal(rngs, (E, I, D), dtype, fan_in=D), axes=gate_up)
        self.down_proj = nnx.Param(init_normal(rngs, (E, D, I), dtype, fan_in=I), axes=down)


class FP8Experts(nnx.Module):
    """Routed experts kept in float8_e4m3fn with float32 scales (`--keep-fp8`), dequantised per matmul.

    gate/up: [E,I,D] fp8 with scales [E, I, ceil(D/bi)]; down: [E,D,I] fp8 with scales [E, ceil(D/bo), I]
    ((bo, bi) = the checkpoint's weight_block_size over its [out, in] matrices). The scale grid keeps
    the checkpoint's 128-blocks along D but is expanded along I, so the `model` mesh axis can split I
    at any divisor (1280 / 4 = 320 is not a multiple of 128); this costs 4/128 = 3% extra bytes.
    """

    def __init__(self, cfg: LingConfig):
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.block_out, self.block_in = (int(b) for b in cfg.weight_block_size)
        f8 = jnp.float8_e4m3fn
        gi, go = -(-D // self.block_in), -(-D // self.block_out)
        self.gate_proj = nnx.Param(jnp.zeros((E, I, D), f8))
        self.up_proj = nnx.Param(jnp.zeros((E, I, D), f8))
        self.down_proj = nnx.Param(jnp.zeros((E, D, I), f8))
        self.gate_proj_scale = nnx.Param(jnp.ones((E, I, gi), jnp.float32))
        self.up_proj_scale = nnx.Param(jnp.ones((E, I, gi), jnp.float32))
        self.down_proj_scale = nnx.Param(jnp.ones((E, go, I), jnp.float32))

    def weights(self):
        return (self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                self.gate_proj_scale[...], self.up_proj_scale[...], self.down_proj_scale[...])


def dequant_cols(wq, s, block: int, dtype):
    """gate/up [..., I, D] fp8 × scale [..., I, ceil(D/block)] → dtype (product formed in float32)."""
    D = wq.shape[-1]
    return (wq.astype(jnp.float32) * jnp.repeat(s, block, axis=-1)[..., :D]).astype(dtype)


def dequant_rows(wq, s, block: int, dtype):
    """down [..., D, I] fp8 × scale [..., ceil(D/block), I] → dtype (product formed in float32)."""
    D = wq.shape[-2]
    return (wq.astype(jnp.float32) * jnp.repeat(s, block, axis=-2)[..., :D, :]).astype(dtype)


def experts_local(x, idx, wts, e0, weights, limit, impl: str, blocks=None):
    """Weighted sum over the assignments that fall on experts `e0 .. e0+E_l-1` (the ones in `weights`).

    x: [N,D]; idx: [N,k] global expert ids; wts: [N,k] f32; weights: (wg, wu, wd) stacked [E_l,I_l,D],
    [E_l,I_l,D], [E_l,D,I_l], plus (sg, su, sd) scales when `blocks=(block_in, block_out)` (FP8).
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

    bi, bo = blocks if blocks is not None else (None, None)
    if impl == "gather":
        li = jnp.where(mine, loc, 0)
        if blocks is None:  # each token gathers its experts inside the per-token loop
            y = experts_gathered(x, li, wg, wu, wd, limit)
        else:               # FP8: gather weights + scales, dequantise, then the same per-token loop
            sg, su, sd = (s[li] for s in weights[3:])
            y = experts_gathered(x, li, dequant_cols(wg[li], sg, bi, dt), dequant_cols(wu[li], su, bi, dt),
                                 dequant_rows(wd[li], sd, bo, dt), limit, gathered=True)
    else:
        sc = (None,) * 3 if blocks is None else weights[3:]
        ws = (deq(wg, sc[0], dequant_cols, bi), deq(wu, sc[1], dequant_cols, bi), deq(wd, sc[2], dequant_rows, bo))
        y = experts_grouped(x, jnp.where(mine, loc, E_l), *ws, limit)  # other devices' assignments: id E_l, 0
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
    sum_axes = tuple(a for a in (e_ax, plan.specs[0][1]) if a is not None)  # gate [E, I, D]: expert, I axes

    def body(x, idx, wts, limit, *ws):
        e0 = jax.lax.axis_index(e_ax) * ws[0].shape[0] if e_ax is not None else 0
        y = experts_local(x, idx, wts, e0, ws, limit, impl, blocks)
        return jax.lax.psum(y, sum_axes) if sum_axes else y

    tp = P(tok, None)
    lim = jnp.asarray(limit, jnp.float32)  # may be traced (per-layer SwiGLULimit): an explicit replicated input
    # check_vma=False: the inner kernels (e.g. the CPU spill loop) start carries from
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
        self.routed_limit = SwiGLULimit(jnp.asarray(routed_limit, jnp.float32), axes=())
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared_experts = (SwiGLU(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts,
                                      dtype=dtype, rngs=rngs, limit=shared_limit)
                               if cfg.num_shared_experts else None)

    def __call__(self, x, forced_idx=None, impl: str = "auto", kernel_impl: str | None = None):
        """x: [B,T,D] → (y [B,T,D], expert ids [B,T,k]). `forced_idx` pins the routing decisions
        (k distinct experts per token, as the router picks them).

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
        weights = ex.weights() if fp8 else (ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...])
        blocks = (ex.block_in, ex.block_out) if fp8 else None
        if plan is not None:
            y = experts_ep(xf, idx, wts, weights, self.routed_limit[...], plan, inner, blocks)
        else:  # one device holds every expert: the local kernel with all of them
            y = experts_local(xf, idx, wts, 0, weights, self.routed_limit[...], inner, blocks)
        y = y.astype(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf, kernel_impl)
        return y.reshape(B, T, D), idx.reshape(B, T, -1)
