"""The decoder layers stored the way they run: `LayerStack`, the layer plan, and the cache layout.

Why a plan: XLA compile time grows with the unrolled program. Consecutive layers of one kind
(KDA+MoE, say) form a *run*; a pattern of runs that repeats (7 KDA + 1 MLA, eight times in the
release) forms a *block* scanned over its repeats, with each run inside scanned over its layers.
The real schedule becomes 5 blocks (4 dense KDA | 3 KDA | (MLA, 7 KDA) × 8 | MLA) and compiles six
layer bodies instead of 72.

Why the parameters are stored stacked: a scan reads each layer's weights as slices of arrays
stacked `[repeats, n, ...]`. Stacking per-layer parameters inside a program (what ling-jax did
before) builds a copy of every layer weight in every prefill, decode and verify step (~40 GiB per
device for the release on 8×H200). So the layer loop is a *load-time* choice (`ExecConfig.layer_loop`
when the model is built or loaded): "scan" stores each run's parameters stacked once
(`LayerStack.runs[block][run]`, a DecoderLayer whose every array has two leading axes
`[repeats, n]`, logical axis "layers", never split), "unroll" stores one DecoderLayer per layer
(`LayerStack.per_layer[i]`: on XLA:CPU a scanned weight slice is copied before its matmul, so
shallow wide models read their weights in place unrolled; the routed experts, the largest, are read in
place when scanned too: the native kernel gets the run's stacks as one table and this layer's first
row, `moe.ExpertTable`). `set_loop` converts between the two
outside any program. Checkpoints stay per layer: the loader, the converter, the exporter and the
trainer's saved names see per-layer paths `model/layers/{i}/...` (`canonical_path`,
`stacked_layer_paths`).

Why caches are carried through the scan: a cache passed as the scan's per-layer input and returned
as its per-layer output is a new stacked buffer (the engine's whole page pool and slot pool copied
every step). Here a run's stacked cache is part of the scan's carry: a KDA layer reads its state at
[g, j] and writes it back there; an MLA layer gets the whole stacked cache with `layer = (g, j)` and
writes only its new tokens at [g, j, page, offset] (`ling_jax.mla`). With the pools donated, every
write lands in place.

The cache layout (per block of the plan, per run, arrays `[repeats, n, ...]`) has one owner too:
`zeros_by_kind`, `map_runs`, `layer_location` and `layer_of` below.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ling_jax.call_mode import FORWARD, CallMode
from ling_jax.checkpoint.layout import canonical_path
from ling_jax.config import KDA, LingConfig
from ling_jax.decoder_layer import DecoderLayer
from ling_jax.exec_config import LAYER_LOOPS, ExecConfig
from ling_jax.expert_panels import PanelOrdered
from ling_jax.kda import CONV_FIELDS, KDAState, SlotKDAState, conv_like, conv_window, kda_in_place, kda_rollback
from ling_jax.linear import Linear, TableRows
from ling_jax.mla import MLACache, PagedMLACache
from ling_jax.moe import ExpertTable, Router
from ling_jax.placement import stack_format, model_mesh
from ling_jax.rows import take_rows
from pallas_kernels.linear import cpu_kernel as table_kernel


@dataclasses.dataclass(frozen=True)
class Run:
    attn: str   # "kda" | "mla"
    moe: bool
    n: int      # layers in the run


@dataclasses.dataclass(frozen=True)
class Block:
    start: int          # first layer index
    runs: tuple         # Run, ...
    repeats: int        # the runs pattern repeats this many times

    @property
    def stride(self) -> int:
        return sum(r.n for r in self.runs)

    def layer_grid(self, r: int) -> list[list[int]]:
        """Layer indices of run r: [repeats][n]."""
        off = self.start + sum(x.n for x in self.runs[:r])
        return [[off + g * self.stride + i for i in range(self.runs[r].n)] for g in range(self.repeats)]


@functools.lru_cache(maxsize=64)
def layer_plan(cfg: LingConfig) -> tuple[Block, ...]:
    """Split the layer schedule into blocks of repeated run patterns (greedy, pattern length ≤ 2)."""
    sig = [(t, cfg.is_moe(i)) for i, t in enumerate(cfg.layer_types)]
    runs, starts = [], []
    for i, s in enumerate(sig):
        if runs and (runs[-1].attn, runs[-1].moe) == s:
            runs[-1] = dataclasses.replace(runs[-1], n=runs[-1].n + 1)
        else:
            runs.append(Run(s[0], s[1], 1))
            starts.append(i)
    blocks, i = [], 0
    while i < len(runs):
        best = (1, 1)
        for p in (2, 1):
            m = 1
            while runs[i + m * p:i + (m + 1) * p] == runs[i:i + p] and i + (m + 1) * p <= len(runs):
                m += 1
            if m > 1 and m * p > best[0] * best[1]:
                best = (p, m)
        p, m = best
        blocks.append(Block(starts[i], tuple(runs[i:i + p]), m))
        i += p * m
    return tuple(blocks)


# ---------------------------------------------------------------------------------------------
# the cache layout: per block, per run, arrays [repeats, n, ...]
# ---------------------------------------------------------------------------------------------
def zeros_by_kind(cfg: LingConfig, make_kda: Callable, make_mla: Callable) -> tuple:
    """Per block, per run: `make_kda()` or `make_mla()` (a pytree of one layer; None = nothing)
    broadcast to `[repeats, n, ...]` (a real buffer, not a broadcast view: it is written in place)."""
    def stacked(make, block, r):
        one = make()
        if one is None:
            return None
        m, n = block.repeats, block.runs[r].n
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (m, n) + x.shape).copy(), one)
    return tuple(tuple(stacked(make_kda if run.attn == KDA else make_mla, b, r) for r, run in enumerate(b.runs))
                 for b in layer_plan(cfg))


def map_runs(cfg: LingConfig, fn: Callable, *trees) -> tuple:
    """Per block, per run: `fn(run, *values)` over trees laid out like `zeros_by_kind`'s."""
    return tuple(tuple(fn(run, *(t[b][r] for t in trees)) for r, run in enumerate(block.runs))
                 for b, block in enumerate(layer_plan(cfg)))


def layer_location(cfg: LingConfig, layer: int) -> tuple[int, int, int, int]:
    """(block, run, repeat g, index j in the run) of main layer `layer`."""
    for b, block in enumerate(layer_plan(cfg)):
        for r in range(len(block.runs)):
            for g, row in enumerate(block.layer_grid(r)):
                if layer in row:
                    return b, r, g, row.index(layer)
    raise IndexError(f"layer {layer} out of range (the model has {cfg.num_hidden_layers})")


def layer_of(cfg: LingConfig, tree, layer: int):
    """Layer `layer`'s own value (leading [repeats, n] dropped) of a tree laid out like `zeros_by_kind`'s."""
    b, r, g, j = layer_location(cfg, layer)
    return jax.tree.map(lambda x: x[g, j], tree[b][r])


def roll_back_kda(cfg: LingConfig, after: tuple, kda_states: dict, n_keep: jax.Array) -> tuple:
    """The cache layers after a verify forward of which only the first n_keep[b] tokens stay: each KDA
    run rebuilt from the per-token rollback info `kda_states[(block, run)]` alone (`kda.kda_rollback`,
    over the run's [repeats, n] axes: the state before the verify is not needed, so the pools the
    verify updated in place are never copied to keep it); each MLA run as `after` (the rejected tokens
    lie past the new length, masked). Shared by `generate` and the engine's verify."""
    roll = jax.vmap(jax.vmap(kda_rollback, in_axes=(0, None)), in_axes=(0, None))
    return tuple(tuple(roll(kda_states[(b, r)], n_keep) if run.attn == KDA else after[b][r]
                       for r, run in enumerate(block.runs)) for b, block in enumerate(layer_plan(cfg)))


def per_layer(block: Block, r: int, stacked_value):
    """{layer index: value} from a run's stacked [repeats, n, ...] output."""
    grid = block.layer_grid(r)
    return {li: stacked_value[g, i] for g, row in enumerate(grid) for i, li in enumerate(row)}


def stack_forced(block: Block, r: int, forced: dict | None):
    """Forced expert ids {layer: [B,T,k]} of a MoE run stacked [repeats, n, B, T, k] (else None)."""
    if forced is None or block.runs[r].moe is False:
        return None
    grid = block.layer_grid(r)
    return _stack([forced[li] for row in grid for li in row], block.repeats, len(grid[0]))


def _stack(vals: list, repeats: int, n: int):
    """Per-layer values (pytrees, or all None) in (repeat, layer) order → stacked [repeats, n, ...]."""
    if vals[0] is None:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs).reshape((repeats, n) + xs[0].shape), *vals)


# ---------------------------------------------------------------------------------------------
# parameters stacked per run
# ---------------------------------------------------------------------------------------------
def _placed_spec(x):
    """x's NamedSharding, or None (a tracer, one device, a ShapeDtypeStruct without one)."""
    if isinstance(x, jax.core.Tracer):
        return None
    sh = getattr(x, "sharding", None)
    return sh if isinstance(sh, NamedSharding) else None


@functools.lru_cache(maxsize=None)
def _stacker(repeats: int, n: int, out_sh):
    return jax.jit(lambda *a: jnp.stack(a).reshape((repeats, n) + a[0].shape), out_shardings=out_sh)


@functools.lru_cache(maxsize=None)
def _slicer(out_sh):
    return jax.jit(lambda a, g, j: a[g, j], out_shardings=out_sh)


def _stack_leaves(xs: list, repeats: int, n: int, free: bool, loop_layouts: bool = False, block_scales: bool = False):
    """One stacked leaf [repeats, n, ...] from per-layer leaves: shapes only for ShapeDtypeStructs;
    placed like the pieces (their spec behind two replicated axes; with `loop_layouts`, a stack
    in the layout the TPU loop reads: `placement.stack_format`, told whether the leaf is a BlockFP8's
    `scales`); the pieces freed when `free`."""
    x0, sh = xs[0], _placed_spec(xs[0])
    out_sh = None if sh is None else NamedSharding(sh.mesh, P(None, None, *sh.spec))
    shape = (repeats, n) + tuple(x0.shape)
    if loop_layouts:
        out_sh = stack_format(shape, x0.dtype, out_sh, block_scales)
    if isinstance(x0, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, x0.dtype, sharding=out_sh)
    if isinstance(x0, jax.core.Tracer):
        return jnp.stack(xs).reshape(shape)
    out = _stacker(repeats, n, out_sh)(*xs)
    if free:
        for x in xs:
            x.delete()
    return out


def _unstack_leaf(x, g: int, j: int):
    sh = _placed_spec(x)
    out_sh = None if sh is None else NamedSharding(sh.mesh, P(*tuple(sh.spec)[2:]))
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[2:], x.dtype, sharding=out_sh)
    if isinstance(x, jax.core.Tracer):
        return x[g, j]
    return _slicer(out_sh)(x, g, j)


def _set_stack_axes(state, add: bool) -> None:
    """Mark (or unmark) every Variable of `state` as stacked: metadata `stacked_axes` = 2, the two
    leading "layers" axes placement puts in front of its declared `axes` (`placement.variable_axes`). The
    declared `axes` stay one layer's: inside the scan each layer sees its own slice, and the layer
    code (the expert-parallel shard_map) reads them."""
    for _, var in nnx.to_flat_state(state):
        var.set_metadata(stacked_axes=2 if add else 0)


def stack_modules(modules: list, repeats: int, n: int, *, free: bool = False, loop_layouts: bool = False) -> nnx.Module:
    """One module of the layers' common structure whose every array is stacked [repeats, n, ...]
    (modules in (repeat, layer) order). `free`: delete each layer's arrays once stacked (the loader:
    device memory holds the model plus one stacked parameter, not two models). `loop_layouts`:
    `ExecConfig.loop_stack_layouts`."""
    splits = [nnx.split(m) for m in modules]
    gdef = splits[0][0]
    for i, (g, _) in enumerate(splits):
        if g != gdef:
            raise ValueError(f"layer {i} of a run differs in structure from the first and cannot be stacked "
                             f"with it (a parameter quantised in some layers of a run only?)")
    states = [s for _, s in splits]
    stacked = jax.tree_util.tree_map_with_path(
        lambda path, *xs: _stack_leaves(list(xs), repeats, n, free, loop_layouts, _is_block_scales(path)), *states)
    _set_stack_axes(stacked, add=True)
    return nnx.merge(gdef, stacked)


def _is_block_scales(path) -> bool:
    """Whether a leaf path of a module state ends in a `BlockFP8`'s `scales` (recognised by the
    quantised value's structure, not by a list of names)."""
    return bool(path) and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "scales" \
        and len(path) >= 2 and isinstance(path[-2], jax.tree_util.GetAttrKey) and path[-2].name == "value"


def unstack_module(module: nnx.Module, g: int, j: int) -> nnx.Module:
    """Layer (g, j) of a stacked module, as a module of its own (arrays sliced: a copy)."""
    gdef, state = nnx.split(module)
    one = jax.tree.map(lambda x: _unstack_leaf(x, g, j), state)
    _set_stack_axes(one, add=False)
    return nnx.merge(gdef, one)


def is_stacked_path(path) -> bool:
    p = [str(x) for x in path]
    return len(p) > 4 and p[0] == "model" and p[1] == "layers" and p[2] == "runs"


def stacked_layer_paths(path, cfg: LingConfig) -> list[tuple[tuple, int, int]]:
    """[(per-layer path `model/layers/{i}/...`, g, j)] of a stacked parameter path
    `model/layers/runs/{block}/{run}/...`: where each layer's value sits in the stack."""
    p = tuple(path)
    b, r = int(p[3]), int(p[4])
    block = layer_plan(cfg)[b]
    return [(("model", "layers", li) + p[5:], g, j)
            for g, row in enumerate(block.layer_grid(r)) for j, li in enumerate(row)]


def per_layer_arrays(path, a, cfg: LingConfig) -> list[tuple[tuple, object]]:
    """[(per-layer path, that layer's array)] of one parameter value `a` (a stacked one gives every
    layer of its run, sliced at [g, j]; any other its canonical path and `a`)."""
    if is_stacked_path(path):
        return [(lp, a[g, j]) for lp, g, j in stacked_layer_paths(path, cfg)]
    return [(canonical_path(path), a)]


class LayerStack(nnx.Module):
    """The decoder layers of a `LingModel`, stored as they run (module doc), and their layer loop.

    loop "scan": `runs[b][r]` is one DecoderLayer per run of `layer_plan(cfg)` with arrays stacked
    [repeats, n, ...]; loop "unroll": `per_layer[i]` is layer i. `layer(i)` reads layer i either way."""

    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs, loop: str = "scan"):
        if loop not in LAYER_LOOPS:
            raise ValueError(f"layer loop must be one of {LAYER_LOOPS}, got {loop!r}")
        self.cfg = cfg
        self.loop = "unroll"
        self.per_layer = nnx.data(nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs)
                                            for i in range(cfg.num_hidden_layers)]))
        self.runs = nnx.data(None)
        if loop == "scan":
            self.set_loop("scan")

    @property
    def plan(self) -> tuple:
        return layer_plan(self.cfg)

    def __len__(self) -> int:
        return self.cfg.num_hidden_layers

    def __getitem__(self, i: int) -> DecoderLayer:
        return self.layer(i)

    def layer(self, i: int) -> DecoderLayer:
        """Layer i: its own module (unrolled) or a sliced copy of it (stacked; for reading)."""
        if self.loop == "unroll":
            return self.per_layer[i]
        b, r, g, j = layer_location(self.cfg, i)
        return unstack_module(self.runs[b][r], g, j)

    def set_loop(self, loop: str, *, free: bool = False, loop_layouts: bool = False) -> "LayerStack":
        """Store the layers for `loop` ("scan": stacked per run; "unroll": per layer), outside any
        program (arrays keep their placement; `free` deletes the old arrays as it goes; `loop_layouts`:
        stacks in the layouts the TPU loop reads, `ExecConfig.loop_stack_layouts`)."""
        if loop not in LAYER_LOOPS:
            raise ValueError(f"layer loop must be one of {LAYER_LOOPS}, got {loop!r}")
        if loop == self.loop:
            return self
        if loop == "scan":
            runs = []
            for block in self.plan:
                runs.append(nnx.List([stack_modules([self.per_layer[i] for row in block.layer_grid(r) for i in row],
                                                    block.repeats, block.runs[r].n, free=free,
                                                    loop_layouts=loop_layouts)
                                      for r in range(len(block.runs))]))
            self.runs, self.per_layer = nnx.data(nnx.List(runs)), nnx.data(None)
        else:
            layers = [None] * self.cfg.num_hidden_layers
            for b, block in enumerate(self.plan):
                for r in range(len(block.runs)):
                    for g, row in enumerate(block.layer_grid(r)):
                        for j, li in enumerate(row):
                            layers[li] = unstack_module(self.runs[b][r], g, j)
            self.per_layer, self.runs = nnx.data(nnx.List(layers)), nnx.data(None)
        self.loop = loop
        return self

    def run_block(self, b: int, h, caches, forced, lengths, n_valid, ex: ExecConfig, fresh=None,
                  mode: CallMode = FORWARD):
        """Block b of the plan over h [B,T,D] (the one layer runner: forward, prefill, decode,
        verification and training all come through here).

        caches / forced: per run of the block, stacked [repeats, n, ...] (or None); fresh: None or
        [B] bool, rows whose KDA state reads as zero; mode: what the call is for (`CallMode`). Returns (h, per-run new caches, per-run expert
        ids [repeats, n, B, T, k] or None, per-run extras (KDA rollback info or boundary states))."""
        if ex.layer_loop != self.loop:
            raise ValueError(f"ExecConfig.layer_loop={ex.layer_loop!r}, but the layers are stored for "
                             f"{self.loop!r} (the layer loop is chosen when the model is built or loaded; "
                             f"convert with model.set_layer_loop({ex.layer_loop!r}))")
        block = self.plan[b]
        slots = [isinstance(c, KDAState) and kda_in_place(ex, mode, c.recurrent.dtype) and model_mesh(self) is None
                 for c in caches]
        # a decode's KDA states stay where they are (`kda.SlotKDAState`): updated in place by the
        # native kernel, each row its own slot of the stacked cache
        caches = tuple(_as_slots(c, fresh) if s else c for c, s in zip(caches, slots))
        if self.loop == "unroll":
            out = _run_unrolled(block, self.per_layer, h, caches, forced, lengths, n_valid, ex, mode, fresh)
        else:
            out = _run_scanned(block, self.runs[b], h, caches, forced, lengths, n_valid, ex, mode, fresh)
        h, new_c, idxs, extras = out
        new_c = tuple(KDAState(*c[:4]) if s else c for c, s in zip(new_c, slots))
        return h, new_c, idxs, extras


# ---------------------------------------------------------------------------------------------
# the layer loop
# ---------------------------------------------------------------------------------------------
def _layer_fn(gdef, ex: ExecConfig, mode: CallMode):
    """`(params, h, cache, forced, lengths, n_valid) -> (h, cache, expert ids, extra)` of one layer
    structure, rematerialised in the backward pass under `ex.remat` when set (training)."""
    def call(p, h, c, f, lengths, n_valid, experts=None):
        return nnx.merge(gdef, p)(h, c, lengths, n_valid, ex, f, mode, experts)
    if ex.remat is None:
        return call
    return jax.checkpoint(call, policy=getattr(jax.checkpoint_policies, ex.remat))


def _is_mla(cache) -> bool:
    return isinstance(cache, (MLACache, PagedMLACache))


def _as_slots(c: KDAState, fresh) -> SlotKDAState:
    """A run's stacked KDA cache [repeats, n, B, ...] as a SlotKDAState whose row b is slot b."""
    B = c.recurrent.shape[2]
    return SlotKDAState(c.recurrent, c.conv_q, c.conv_k, c.conv_v, jnp.arange(B, dtype=jnp.int32), fresh)


def _cache_at(cache, g, j, fresh=None, static: bool = False):
    """What layer (g, j) of a run gets of the run's stacked cache: a KDA state read at [g, j] (rows
    `fresh` [B] read as zero); an MLA cache whole, with its `layer` set (the attention reads and
    writes its own layer in place). static: g, j are Python ints (unrolled) and the state has one
    reader (not a verify, whose rollback keeps the state it started from)."""
    if cache is None:
        return None
    if _is_mla(cache):
        return cache._replace(layer=(g, j))
    def read(x, static):
        m, n = x.shape[:2]
        if static:
            y = x[g, j]
        else:
            flat = x.reshape((m * n,) + x.shape[2:])
            y = take_rows(flat, jnp.asarray(g * n + j, jnp.int32).reshape(1), axis=0)[0]
        if fresh is not None:
            y = jnp.where(fresh.reshape((-1,) + (1,) * (y.ndim - 1)), jnp.zeros((), y.dtype), y)
        return y
    # The recurrent state of an unrolled layer, `static`: a static slice, which XLA:CPU reads in
    # place (a one-row gather copied every layer's rows: 15% of a 32-row mid-config decode step,
    # BENCHMARKS.md "Serving, seventeenth session"). Otherwise a gather of [g, j] (`rows.take_rows`
    # keeps it one): a slice would be fused into each of the state's readers (the conv states feed q,
    # k and v), leaving the stacked pool read by fusions XLA cannot order before the in-place write,
    # so it copied the whole pool (tests/test_inplace_rows.py).
    # (the TPU pools keep the conv windows as taps, `kda.conv_taps`: each tap read, the layer gets the window)
    convs = {f: conv_window(jax.tree.map(lambda x: read(x, False), getattr(cache, f))) for f in CONV_FIELDS}
    if isinstance(cache, SlotKDAState):  # the recurrent states stay in their pool: the layer gets (g, j)
        return cache._replace(layer=(g, j), **convs)
    return cache._replace(recurrent=read(cache.recurrent, static), **convs)


def _cache_put(cache, new, g, j):
    """The run's stacked cache after layer (g, j) returned `new` (in-place writes: donated or carried)."""
    if cache is None:
        return None
    if _is_mla(cache):
        return new._replace(layer=None)
    new = conv_like(new, cache)  # the conv windows in the stacked cache's form (taps in the pools)
    put = lambda buf, x: buf.at[g, j].set(x.astype(buf.dtype))  # noqa: E731
    if isinstance(cache, SlotKDAState):  # the pool came back updated in place; the conv rows go to [g, j]
        convs = {f: jax.tree.map(put, getattr(cache, f), getattr(new, f)) for f in CONV_FIELDS}
        return cache._replace(recurrent=new.recurrent, **convs)
    return jax.tree.map(put, cache, new)


def _expert_table(stack, g, j, ex: ExecConfig) -> ExpertTable | None:
    """Layer (g, j)'s routed experts as rows of the run's stacked float weights (`moe.ExpertTable`)
    for the native CPU kernel, which reads them in place; None where it cannot run them (another
    platform, the kernel off, quantised experts, a run without experts). The layer's own slices stay
    in `p` for every other path; whichever goes unused is dropped by XLA, so a slice is copied only
    where it is read."""
    if not (ex.native_experts and ex.platform == "cpu" and "mlp" in stack and "experts" in stack["mlp"]):
        return None
    ws = tuple(stack["mlp"]["experts"][k] for k in ("gate_proj", "up_proj", "down_proj"))
    ws = tuple(w.get_value() if isinstance(w, nnx.Variable) else w for w in ws)
    packed = isinstance(ws[0], PanelOrdered)  # stored in the kernel's panel order: each expert's block intact
    if packed:
        ws = tuple(w.values for w in ws)
    if not all(isinstance(w, jax.Array) and w.ndim == 5 for w in ws):  # kept quantised: BlockFP8 / MXFP4
        return None
    m, n, E = ws[0].shape[:3]
    return ExpertTable(tuple(w.reshape((m * n * E,) + w.shape[3:]) for w in ws),
                       ((g * n + j) * E).astype(jnp.int32), packed)


def _linear_weights(run, ex: ExecConfig) -> frozenset:
    """Paths (module path + "weight") of the Linear and router weights of a scanned run that its layers
    get as `linear.TableRows` (`ExecConfig.native_linear`: XLA:CPU, one device, the kernel built);
    empty where they get slices."""
    if not (ex.native_linear and ex.platform == "cpu" and model_mesh(run) is None and table_kernel.available()):
        return frozenset()
    return frozenset(tuple(p) + ("weight",) for p, node in nnx.iter_graph(run) if isinstance(node, (Linear, Router)))


def _layer_params(stack, g, j, linear_weights: frozenset):
    """Layer (g, j)'s parameters from its run's stacked state: each array sliced at [g, j], except a
    float32 Linear or router weight named in `linear_weights`, which becomes its rows of the run's stack merged
    into one table (`linear.TableRows`; a reshape, not a copy): the native kernel reads it in place,
    where XLA:CPU copies a dynamic slice before the dot that reads it."""
    def one(path, x):
        keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
        if (linear_weights and keys[:-1] in linear_weights and keys[-1] == "value" and isinstance(x, jax.Array)
                and x.ndim == 4 and x.dtype == jnp.float32):
            m, n, rows, cols = x.shape
            return TableRows(x.reshape(m * n * rows, cols), ((g * n + j) * rows).astype(jnp.int32), rows)
        return layer_slice(x, g, j)
    return jax.tree_util.tree_map_with_path(one, stack)


def layer_slice(x, g, j):
    """x[g, j] of a stack [repeats, n, ...] at the loop's indices (0 <= g < repeats, 0 <= j < n): one
    dynamic slice that does not map negative indices. Why not `x[g, j]`: numpy indexing with traced
    indices first maps them (a compare, an add and a select per index), ~9 equations a parameter
    where this is 2, and a scanned layer slices ~180 parameters in every program (the tiny config's
    decode program: 3,686 -> 3,107 equations)."""
    starts = (g, j) + (0,) * (x.ndim - 2)
    return jax.lax.dynamic_slice(x, starts, (1, 1) + tuple(x.shape[2:]),
                                 allow_negative_indices=False).reshape(x.shape[2:])


def _run_scanned(block: Block, runs, h, caches, forced, lengths, n_valid, ex: ExecConfig, mode: CallMode,
                 fresh=None):
    """The block as a scan over its repeats of a scan per run over the run's layers. The stored
    parameter stacks are loop-invariant operands indexed at [g, j] by the inner body (as scan inputs
    the outer loop would first copy out a whole repeat's slice of every stack); caches ride in the
    carry (module doc). On XLA:CPU the float32 Linear weights reach the layer as their rows of the
    stack, read in place (`_layer_params`)."""
    gdefs, params = zip(*(nnx.split(m) for m in runs))
    fns = [_layer_fn(gd, ex, mode) for gd in gdefs]
    linears = [_linear_weights(m, ex) for m in runs]

    def group_body(carry, xs):
        h, cs = carry
        g, forced_g = xs
        cs, idxs, extras = list(cs), [], []
        for r, fn in enumerate(fns):
            def layer_body(carry, ys, fn=fn, stack=params[r], lw=linears[r]):
                h, c = carry
                j, f = ys
                p = _layer_params(stack, g, j, lw)
                h, new, idx, extra = fn(p, h, _cache_at(c, g, j, fresh), f, lengths, n_valid,
                                        _expert_table(stack, g, j, ex))
                return (h, _cache_put(c, new, g, j)), (idx, extra)
            n = block.runs[r].n
            (h, cs[r]), (idx, extra) = jax.lax.scan(layer_body, (h, cs[r]), (jnp.arange(n, dtype=jnp.int32), forced_g[r]))
            idxs.append(idx)
            extras.append(extra)
        return (h, tuple(cs)), (tuple(idxs), tuple(extras))

    g_idx = jnp.arange(block.repeats, dtype=jnp.int32)
    (h, new_c), (idxs, extras) = jax.lax.scan(group_body, (h, tuple(caches)), (g_idx, tuple(forced)))
    return h, new_c, idxs, extras


def _run_unrolled(block: Block, layers, h, caches, forced, lengths, n_valid, ex: ExecConfig, mode: CallMode,
                  fresh=None):
    """The block with every layer applied in turn to its own parameters; caches updated in place
    at [g, j] like the scan's."""
    cs = list(caches)
    per_run = [dict() for _ in block.runs]
    static = not mode.kda_states  # (`_cache_at`)
    for g in range(block.repeats):
        for r, run in enumerate(block.runs):
            for j, li in enumerate(block.layer_grid(r)[g]):
                f = None if forced[r] is None else forced[r][g, j]
                gdef, p = nnx.split(layers[li])
                h, new, idx, extra = _layer_fn(gdef, ex, mode)(p, h, _cache_at(cs[r], g, j, fresh, static),
                                                                 f, lengths, n_valid)
                cs[r] = _cache_put(cs[r], new, g, j)
                per_run[r][(g, j)] = (idx, extra)
    idxs, extras = [], []
    for r, run in enumerate(block.runs):
        slots = [(g, j) for g in range(block.repeats) for j in range(run.n)]
        idx, extra = (list(v) for v in zip(*(per_run[r][s] for s in slots)))
        idxs.append(_stack(idx, block.repeats, run.n))
        extras.append(_stack(extra, block.repeats, run.n))
    return h, tuple(cs), tuple(idxs), tuple(extras)
