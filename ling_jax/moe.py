"""The sigmoid-routed, group-limited MoE block (spec §8): router, routed experts, shared expert.

Routed experts are stacked in the checkpoint's per-expert `[out, in]` layout (gate/up `[E, I, D]`,
down `[E, D, I]`) and computed with no Python loop over experts. `ExecConfig.experts` picks the
path: "grouped" runs every expert once over the tokens routed to it (`ExecConfig.grouped_matmul`:
one `ragged_dot_general` per projection on TPU/GPU, or the capacity buffers of
`ling_jax.moe_capacity` on XLA:CPU), "gather" reads only the selected experts' weights (decode),
"auto" picks by the bytes each moves. All give the same result. A model loaded to run on one CPU
device stores its float32 experts in the native kernel's panel order instead (`ling_jax.expert_panels`,
`ExecConfig.expert_panels`): the kernel reads them in place, every other path as rows.

Expert parallelism: when `ExecConfig.mesh` is set, the routed experts run inside `jax.shard_map`
(`experts_ep`): every device computes its own experts (and its slice of their intermediate width)
for all tokens of its data shard and one `psum` over the `expert`/`model` axes combines them; no
expert weight leaves its device (design note: sharding/README.md). Expert weights that are
`BlockFP8` or `MXFP4Blocks` (kept quantised) are dequantised inside the expert matmuls, per device:
the gather path dequantises the picked experts only, the grouped "ragged" path a chunk of
`EXPERT_CHUNK` experts at a time (`experts_ragged_in_chunks`), never the whole stack.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ling_jax.config import LingConfig
from ling_jax.exec_config import ExecConfig
from ling_jax.expert_panels import PanelOrdered, as_rows
from ling_jax.linear import TableRows, init_normal, reads_in_place
from ling_jax.moe_active import experts_for_tokens, native_applies, uses_active_loop
from ling_jax.moe_capacity import expert_capacity, experts_capacity
from ling_jax.ops import einsum, precision, real_tokens
from ling_jax.quantized import MXFP4Blocks, dequantize, is_quantized
from ling_jax.swiglu import SwiGLU, SwiGLULimit, swiglu_act
from ling_jax.placement import param_mesh, swap_minor_spec, value_specs


def route(x: jax.Array, w: jax.Array, bias: jax.Array, cfg: LingConfig):
    """Grouped top-k routing in float32 (spec §8.1).

    x: [N,D]; w: [E,D] (or `linear.TableRows`, `router_logits`); bias: [E]. Returns (idx [N,k] int32,
    weights [N,k] f32). The bias steers selection only; weights are the unbiased sigmoid scores,
    renormalised and × routed_scaling_factor.
    """
    scores = jax.nn.sigmoid(router_logits(x, w))
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


def router_logits(x: jax.Array, w) -> jax.Array:
    """x [N,D] · w [E,D]ᵀ in float32 at HIGHEST precision → [N,E]; w may be a `linear.TableRows` (a
    scanned layer's router rows of its run's stack on XLA:CPU), read in place by the native kernel
    (`linear.reads_in_place`)."""
    x = x.astype(jnp.float32)
    if reads_in_place(w, x.dtype):
        return w.apply(x)
    if isinstance(w, TableRows):
        w = w.matrix()
    return jnp.einsum("nd,ed->ne", x, w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def routing_weights(scores: jax.Array, idx: jax.Array, cfg: LingConfig) -> jax.Array:
    wts = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    return wts * cfg.routed_scaling_factor


_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))


def experts_ragged(x, flat, k: int, wg, wu, wd, limit):
    """Same contract as `experts_capacity`, via one sort + `ragged_dot_general` per projection (a
    native grouped GEMM on TPU/GPU; weights `[E, out, in]` contracted on their last axis, or an MXFP4
    weight stored by columns as its (even, odd) input halves `[E, in/2, out]`, each contracted with the
    activations' even / odd inputs)."""
    M = flat.shape[0]
    E = (wg[0] if isinstance(wg, tuple) else wg).shape[0]
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # rows past sum(sizes) (ids ≥ E) come out 0

    def rd(a, w):
        if isinstance(w, tuple):  # an MXFP4 weight by columns: its (even, odd) inputs, [E, in/2, out] each
            return sum(jax.lax.ragged_dot(h, wi.astype(a.dtype), sizes, precision=precision(a.dtype),
                                          preferred_element_type=jnp.float32)
                       for h, wi in ((a[:, 0::2], w[0]), (a[:, 1::2], w[1]))).astype(a.dtype)
        return jax.lax.ragged_dot_general(a, w.astype(a.dtype), sizes, _RAGGED_DN, precision=precision(a.dtype),
                                          preferred_element_type=jnp.float32).astype(a.dtype)
    ys = rd(swiglu_act(rd(xs, wg), rd(xs, wu), limit), wd)
    return jnp.zeros((M, ys.shape[-1]), ys.dtype).at[order].set(ys)


def experts_grouped(x, idx, wg, wu, wd, limit, grouped_matmul: str = "ragged"):
    """All routed experts, each reading its weights once: x [N,D]; idx [N,k]; wg, wu [E,I,D];
    wd [E,D,I]. grouped_matmul: "ragged" (TPU/GPU) | "capacity" (XLA:CPU). Returns [N,k,D]."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    if grouped_matmul == "capacity":
        y = experts_capacity(x, flat, k, wg, wu, wd, limit, expert_capacity(N, k, wg.shape[0]))
    else:
        y = experts_ragged(x, flat, k, wg, wu, wd, limit)
    return y.reshape(N, k, -1)


def _gathered_token_halves(xn, wg, wu, wd, limit):
    """`_gathered_token` over MXFP4 weights stored by columns, each given as its (even, odd) input
    halves: wg, wu ([k, D/2, I] each), wd ([k, I/2, D] each)."""
    def proj(w, v):  # Σ over the even and the odd inputs: [k, in/2, out] x [.., in/2]
        spec = "kmo,m->ko" if v.ndim == 1 else "kmo,km->ko"
        return einsum(spec, w[0].astype(xn.dtype), v[..., 0::2], dtype=jnp.float32) + \
            einsum(spec, w[1].astype(xn.dtype), v[..., 1::2], dtype=jnp.float32)
    h = swiglu_act(proj(wg, xn).astype(xn.dtype), proj(wu, xn).astype(xn.dtype), limit)
    return proj(wd, h).astype(xn.dtype)


def _gathered_token(xn, wg, wu, wd, limit):
    """One token's k experts: xn [D]; wg, wu [k,I,D]; wd [k,D,I] → [k,D]. The gate/up blocks are
    contracted as one `[k·I, D]` matrix-vector product (XLA:CPU's fastest form for them)."""
    k, I, D = wg.shape
    g = einsum("rd,d->r", wg.reshape(k * I, D).astype(xn.dtype), xn).reshape(k, I)
    u = einsum("rd,d->r", wu.reshape(k * I, D).astype(xn.dtype), xn).reshape(k, I)
    return einsum("kdi,ki->kd", wd.astype(xn.dtype), swiglu_act(g, u, limit))


def _picked(w, ids, dtype):
    """Rows `ids` of an expert stack, dequantised when it is kept quantised (BlockFP8 / MXFP4Blocks; an
    MXFP4 weight stored by columns as its (even, odd) input halves)."""
    if isinstance(w, MXFP4Blocks) and w.columns:
        return w.take(ids).halves(dtype)
    return dequantize(w.take(ids), dtype) if is_quantized(w) else w[ids]


def experts_gathered(x, idx, wg, wu, wd, limit):
    """Same result as `experts_grouped`, reading only the selected experts' weights (few tokens).

    Tokens run one at a time (`lax.map`): per token the selected experts are gathered and read once;
    a batched product over several tokens' gathered weights ran 2-4× slower on XLA:CPU. Kept-quantised
    weights (FP8 / MXFP4) are gathered and dequantised inside the loop, one token's k experts at a time:
    dequantised for all N tokens at once they were the TPU decode's largest temporaries (int32 unpacking
    of [N, k, I, D/2] codes, BENCHMARKS.md fifteenth session).
    """
    token = _gathered_token_halves if isinstance(wg, MXFP4Blocks) and wg.columns else _gathered_token

    def one(a):
        xn, ids = a
        return token(xn, *(_picked(w, ids, xn.dtype) for w in (wg, wu, wd)), limit)

    if x.shape[0] == 1:  # batch-1 decode: no loop at all
        return one((x[0], idx[0]))[None]
    return jax.lax.map(one, (x, idx))


#: Experts dequantised at a time by `experts_ragged_in_chunks` (at most; a divisor of the local experts).
EXPERT_CHUNK = 8


def experts_ragged_in_chunks(x, idx, weights, limit, chunk: int = EXPERT_CHUNK):
    """`experts_grouped(..., "ragged")` over kept-quantised weights (FP8 / MXFP4), `chunk` experts at a time:
    a `scan` over the expert chunks dequantises one chunk's weights and runs the ragged matmuls on the
    assignments that fall on it (the rest of the chunk's groups are empty), so no program holds a
    dequantised copy of the whole expert stack. Why: dequantised at once, the MXFP4 stack of one layer
    is 2.5 GiB of bf16 per device on `tpu7x:2x2x1` plus its int32 unpacking, and the TPU compiler
    refused the real config's 262,144-token prefill (110 GB of temporaries, BENCHMARKS.md fifteenth session).

    x [N,D]; idx [N,k] local expert ids (≥ E_l: none); weights (wg, wu, wd) quantised or float
    [E_l, ...]. Returns [N,k,D] like `experts_grouped`."""
    E_l = weights[0].shape[0]
    c = max(d for d in range(1, min(chunk, E_l) + 1) if E_l % d == 0)

    def one(acc, start):
        ws = tuple(w.experts(start, c).halves(x.dtype) if isinstance(w, MXFP4Blocks) and w.columns
                   else dequantize(w.experts(start, c), x.dtype) if is_quantized(w)
                   else jax.lax.dynamic_slice_in_dim(w, start, c).astype(x.dtype) for w in weights)
        rel = idx - start
        inside = (rel >= 0) & (rel < c)
        y = experts_grouped(x, jnp.where(inside, rel, c), *ws, limit, "ragged")
        return acc + jnp.where(inside[..., None], y, 0).astype(acc.dtype), None

    init = jnp.zeros(idx.shape + (x.shape[-1],), x.dtype)
    return jax.lax.scan(one, init, jnp.arange(0, E_l, c, dtype=jnp.int32))[0]


def auto_expert_path(n_tokens: int, k: int, n_experts: int, grouped_matmul: str, quantized: bool) -> str:
    """`ExecConfig.experts="auto"`: gather copies each assignment's expert weights before reading
    them (3 passes per assignment), the grouped path reads each expert once, so gather wins while
    3·N·k ≤ E; except on XLA:CPU with float weights, where the grouped path's loop over the experts
    in use (`moe_active`, N·k ≤ E) reads each used expert once and beats gather too (kept quantised,
    the grouped path would dequantise every expert, gather only the picked ones)."""
    if grouped_matmul == "capacity" and not quantized:
        return "grouped"
    return "gather" if 3 * n_tokens * k <= n_experts else "grouped"


class Router(nnx.Module):
    def __init__(self, cfg: LingConfig, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (cfg.num_experts, cfg.hidden_size), jnp.float32),
                                axes=("router", "embed"))
        self.expert_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32), axes=("router",))


class Experts(nnx.Module):
    """Routed experts, stacked in the checkpoint's per-expert `[out, in]` layout: gate/up [E,I,D],
    down [E,D,I] (the orientation XLA:CPU's batched matmuls read fastest, see `experts_capacity`).
    Each holds a float array or, kept quantised, a `BlockFP8` with block (1, bi) for gate/up and
    (bo, 1) for down, or an `MXFP4Blocks` (groups of 32 along the last, input axis: D for gate/up,
    I for down), built by `ling_jax.loader`; loaded onto one CPU device, a float32 weight is a
    `expert_panels.PanelOrdered` (the same values in the native kernel's panel order)."""

    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs):
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        gate_up, down = ("expert", "expert_mlp", "embed"), ("expert", "embed", "expert_mlp")
        self.gate_proj = nnx.Param(init_normal(rngs, (E, I, D), dtype, fan_in=D), axes=gate_up)
        self.up_proj = nnx.Param(init_normal(rngs, (E, I, D), dtype, fan_in=D), axes=gate_up)
        self.down_proj = nnx.Param(init_normal(rngs, (E, D, I), dtype, fan_in=I), axes=down)


def experts_local(x, idx, wts, e0, weights, limit, path: str, grouped_matmul: str, native: bool = False):
    """Weighted sum over the assignments that fall on experts `e0 .. e0+E_l-1` (the ones in `weights`).

    x: [N,D]; idx: [N,k] global expert ids; wts: [N,k] f32; weights: (wg, wu, wd) stacked [E_l,I_l,D],
    [E_l,I_l,D], [E_l,D,I_l], each a float array, a `BlockFP8` or an `MXFP4Blocks` (dequantised /
    unpacked here, in x's dtype).
    path: "gather" | "grouped". Assignments to other experts contribute 0. Returns [N,D] float32 (a
    partial sum when the experts or their intermediate width are split over devices).
    On XLA:CPU ("capacity") a grouped call runs the native kernel at any N (float32, `native`) or, with
    N·k ≤ E_l, the XLA loop over the experts in use instead
    (`ling_jax.moe_active`: each used expert read once, all tokens at once; weighted in the loop;
    `native`: the native CPU kernel, `ExecConfig.native_experts`).
    """
    wg = weights[0]
    E_l = wg.shape[0]
    loc = idx - e0
    mine = (loc >= 0) & (loc < E_l)
    dt = x.dtype
    if path == "gather":
        li = jnp.where(mine, loc, 0)
        y = experts_gathered(x, li, *weights, limit)  # each token gathers (and dequantises) in the loop
    elif grouped_matmul == "ragged" and any(is_quantized(w) for w in weights):
        y = experts_ragged_in_chunks(x, jnp.where(mine, loc, E_l), weights, limit)
    else:
        ws = tuple(dequantize(w, dt) for w in weights)
        if grouped_matmul == "capacity" and uses_active_loop(x.shape[0], idx.shape[1], E_l,
                                                             native_applies(native, x, *ws)):
            return experts_for_tokens(x, jnp.where(mine, loc, E_l), jnp.where(mine, wts, 0.0), *ws, limit, native)
        y = experts_grouped(x, jnp.where(mine, loc, E_l), *ws, limit, grouped_matmul)  # others: id E_l → 0
    y = jnp.where(mine[..., None], y, 0)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), jnp.where(mine, wts, 0.0),
                      precision=jax.lax.Precision.HIGHEST)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertTable:
    """Routed experts as one table per weight, for the native CPU kernel to read a layer's experts in
    place: gate/up [L·E,I,D], down [L·E,D,I] (a scanned run's stacks `[repeats, n, E, ...]` with their
    leading axes merged: a reshape, no copy; or one layer's own weights, L = 1), `base` (int32
    scalar) = the first row of this layer's experts, and `packed`: the tables hold each expert in the
    kernel's panel order (`expert_panels.PanelOrdered`). Why: inside a scan a layer's weights are
    slices of the stacks, and XLA:CPU copies a dynamic slice before the custom call that reads it (the
    mid config scanned: 247 of a 381 ms 8-row decode step copying experts; BENCHMARKS.md "Experts
    read in place in a scan")."""
    weights: tuple
    base: jax.Array
    packed: bool = dataclasses.field(default=False, metadata=dict(static=True))


def experts_from_table(x, idx, wts, table: ExpertTable, n_experts: int, limit):
    """`experts_local` over one layer's `n_experts` experts read from `table` by the native kernel:
    ids outside [0, n_experts) (padding) become the table's out-of-range id, which adds nothing.
    x [N,D] f32, idx / wts [N,k]. Returns [N,D] float32."""
    mine = (idx >= 0) & (idx < n_experts)
    rows = table.weights[0].shape[0]
    return experts_for_tokens(x, jnp.where(mine, idx + table.base, rows), jnp.where(mine, wts, 0.0),
                              *table.weights, limit, True, packed=table.packed)


def experts_ep(x, idx, wts, weights, specs, limit, mesh, path: str, grouped_matmul: str, native: bool = False):
    """Expert-parallel routed experts: `experts_local` per device inside `jax.shard_map`, then psum.

    weights: (wg, wu, wd) as in `experts_local`, placed on `mesh` with `specs` (a PartitionSpec per
    weight, or a BlockFP8 / MXFP4Blocks of PartitionSpecs for a quantised one). Tokens are split over `data` when
    N divides evenly (else every data row computes all tokens). Returns [N,D] float32, identical on
    every device of a data row.
    """
    N = x.shape[0]
    n_data = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("data", 1)
    tok = "data" if n_data > 1 and N % n_data == 0 else None
    gate_spec = specs[0].primary if is_quantized(specs[0]) else specs[0]
    if isinstance(specs[0], MXFP4Blocks) and specs[0].columns:  # stored [E, D/2, I]: back to [E, I, D]
        gate_spec = swap_minor_spec(gate_spec, 3)
    e_ax = gate_spec[0]
    sum_axes = tuple(a for a in (e_ax, gate_spec[1]) if a is not None)  # gate [E, I, D]: expert, I axes

    def body(x, idx, wts, limit, ws):
        e0 = jax.lax.axis_index(e_ax) * ws[0].shape[0] if e_ax is not None else 0
        y = experts_local(x, idx, wts, e0, ws, limit, path, grouped_matmul, native)
        return jax.lax.psum(y, sum_axes) if sum_axes else y

    tp = P(tok, None)
    lim = jnp.asarray(limit, jnp.float32)  # may be traced (per-layer SwiGLULimit): an explicit replicated input
    # check_vma=False: the inner kernels (e.g. the CPU spill loop) start carries from fresh zeros,
    # which the varying-manual-axes type check would reject; psum makes the output replicated over
    # expert/model, as out_specs states.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tp, tp, tp, P(), tuple(specs)), out_specs=tp, check_vma=False)
    return fn(x, idx, wts, lim, tuple(weights))


def weight_specs(experts: "Experts", names, mesh, heads=None) -> tuple:
    """PartitionSpec of each routed-expert weight on `mesh` from its declared logical axes (the
    placement the loader gave it); a BlockFP8 gets a BlockFP8 of specs (`placement.block_fp8_specs`)."""
    return tuple(value_specs(("experts", n), getattr(experts, n), mesh, heads) for n in names)


class MoE(nnx.Module):
    def __init__(self, cfg: LingConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        routed_limit, shared_limit = cfg.swiglu_limits(layer)
        self.routed_limit = SwiGLULimit(jnp.asarray(routed_limit, jnp.float32), axes=())
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared_experts = (SwiGLU(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts,
                                      dtype=dtype, rngs=rngs, limit=shared_limit)
                               if cfg.num_shared_experts else None)

    def __call__(self, x, ex: ExecConfig, forced_idx=None, n_valid=None, table: ExpertTable | None = None):
        """x: [B,T,D] → (y [B,T,D], expert ids [B,T,k]). `forced_idx` pins the routing decisions
        (k distinct experts per token, as the router picks them). n_valid: [B] real tokens per row
        (right padding after) or None (all real): padding tokens are sent to no routed expert (id E,
        which every path drops), so an idle row of a batched step or a prefill row's padding costs
        no expert work where the path does work per assignment (the native CPU kernel, the XLA loop,
        the gather path); their outputs are never read (attention is causal, KDA ignores padding).
        The ids returned are the router's, padding included. table: this layer's experts as rows of
        its scanned run's table (`ExpertTable`), read in place when the native kernel runs them
        (one device, float32; otherwise the layer's own weights, and the table goes unused).

        ex: `experts` path (auto | gather | grouped), `grouped_matmul`, `mesh` (expert-parallel when
        set), `kernels` (the shared expert's quantised projections). Quantised routed experts
        dequantise in XLA inside `experts_local`: the grouped path is a ragged matmul over tokens
        sorted by expert, for which there is no FP8-scale kernel.
        """
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        if forced_idx is None:
            idx, wts = route(xf, self.gate.weight.get_value(), self.gate.expert_bias[...], self.cfg)
        else:
            idx = forced_idx.reshape(B * T, -1)
            wts = routing_weights(jax.nn.sigmoid(router_logits(xf, self.gate.weight.get_value())), idx, self.cfg)
        names = ("gate_proj", "up_proj", "down_proj")
        weights = tuple(getattr(self.experts, n).get_value() for n in names)
        path = ex.experts if ex.experts != "auto" else auto_expert_path(
            B * T, idx.shape[1], self.cfg.num_experts, ex.grouped_matmul, any(is_quantized(w) for w in weights))
        limit = self.routed_limit[...]
        ids = idx
        if n_valid is not None:
            ids = jnp.where(real_tokens(n_valid, T).reshape(B * T, 1), idx, self.cfg.num_experts)
        mesh = param_mesh(self.experts.gate_proj)  # where the experts were placed (static under jit)
        native = (path == "grouped" and ex.grouped_matmul == "capacity" and mesh is None
                  and native_applies(ex.native_experts, xf))
        if native and table is None and isinstance(weights[0], PanelOrdered):  # stored for the kernel: read in place
            table = ExpertTable(tuple(w.values for w in weights), jnp.zeros((), jnp.int32), packed=True)
        if table is not None and native and native_applies(True, *table.weights):
            y = experts_from_table(xf, ids, wts, table, self.cfg.num_experts, limit)
        else:
            weights = tuple(as_rows(w) for w in weights)  # stored in panel order: a copy, for another path
            if mesh is not None:
                specs = weight_specs(self.experts, names, mesh, self.cfg.num_attention_heads)
                y = experts_ep(xf, ids, wts, weights, specs, limit, mesh, path, ex.grouped_matmul, ex.native_experts)
            else:  # one device holds every expert: the local kernel with all of them
                y = experts_local(xf, ids, wts, 0, weights, limit, path, ex.grouped_matmul, ex.native_experts)
        y = y.astype(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf, ex)
        return y.reshape(B, T, D), idx.reshape(B, T, -1)
