"""Running the 72-layer stack as a few scans instead of 72 unrolled layers.

Why: XLA compile time grows with the unrolled program. Consecutive layers of one kind (KDA+MoE,
say) form a *run*; a pattern of runs that repeats (7 KDA + 1 MLA, eight times in the release)
forms a *block* scanned over its repeats, with each run inside scanned over its layers. The real
schedule becomes 5 blocks (4 dense KDA | 3 KDA | (MLA, 7 KDA) × 8 | MLA) and compiles six layer
bodies instead of 72.

Parameters stay per layer in the module tree (the checkpoint, sharding and training see one
module per layer); `stack_params` stacks them per run at trace time — once per compiled call,
outside any decode loop. The cache is stacked the same way natively: `[repeats, layers, ...]`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.exec_config import ExecConfig


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


def stack_params(layers, block: Block):
    """Per run of the block: (graphdef, params stacked [repeats, n, ...])."""
    out = []
    for r in range(len(block.runs)):
        grid = block.layer_grid(r)
        splits = [[nnx.split(layers[i]) for i in row] for row in grid]
        gdef = splits[0][0][0]
        for row in splits:
            for g, _ in row:
                if g != gdef:
                    raise ValueError(f"layers {grid} differ in structure and cannot be scanned together")
        out.append((gdef, _stack([st for row in splits for _, st in row], block.repeats, len(grid[0]))))
    return out


def _layer_fn(gdef, ex: ExecConfig):
    """`(params, h, cache, forced, lengths, n_valid) -> (h, cache, expert ids, extra)` of one layer
    structure, rematerialised in the backward pass under `ex.remat` when set (training)."""
    def call(p, h, c, f, lengths, n_valid):
        return nnx.merge(gdef, p)(h, c, lengths, n_valid, ex, f)
    if ex.remat is None:
        return call
    return jax.checkpoint(call, policy=getattr(jax.checkpoint_policies, ex.remat))


def _stack(vals: list, repeats: int, n: int):
    """Per-layer values (pytrees, or all None) in (repeat, layer) order → stacked [repeats, n, ...]."""
    if vals[0] is None:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs).reshape((repeats, n) + xs[0].shape), *vals)


def run_block(block: Block, layers, stacked, h, caches, forced, lengths, n_valid, ex: ExecConfig):
    """Apply the layers of `block` to h [B,T,D]: the one layer runner (forward, prefill, decode,
    verification and training all come through here).

    layers: the model's layer list; stacked: `stack_params(layers, block)` (or None: computed
    here) for the scanned loop; caches / forced: per run, stacked [repeats, n, ...] (or None).
    `ex.layer_loop`: "scan" runs each run as a `lax.scan` over its stacked parameters inside a scan
    over the block's repeats (six compiled layer bodies for the release's 72 layers); "unroll"
    applies every layer to its own parameters. Why both: inside a scan each layer's weights are
    dynamic slices of the stacked arrays, and XLA:CPU copies every slice before the matmul, so a
    decode step moves each weight three times instead of once; unrolled, the matmuls read the
    parameters in place while the caches stay stacked and are updated slot by slot.

    Returns (h, per-run new caches, per-run expert ids [repeats,n,B,T,k] or None, per-run extras).
    """
    if ex.layer_loop == "unroll":
        return _run_unrolled(block, layers, h, caches, forced, lengths, n_valid, ex)
    stacked = stacked if stacked is not None else stack_params(layers, block)
    fns = [_layer_fn(gdef, ex) for gdef, _ in stacked]

    def group_body(h, xs):
        params_g, caches_g, forced_g = xs
        new_c, idxs, extras = [], [], []
        for r, fn in enumerate(fns):
            def layer_body(h, ys, fn=fn):
                p, c, f = ys
                h, c, idx, extra = fn(p, h, c, f, lengths, n_valid)
                return h, (c, idx, extra)
            h, (c, idx, extra) = jax.lax.scan(layer_body, h, (params_g[r], caches_g[r], forced_g[r]))
            new_c.append(c)
            idxs.append(idx)
            extras.append(extra)
        return h, (tuple(new_c), tuple(idxs), tuple(extras))

    params = tuple(p for _, p in stacked)
    h, (new_c, idxs, extras) = jax.lax.scan(group_body, h, (params, caches, forced))
    return h, new_c, idxs, extras


def _run_unrolled(block: Block, layers, h, caches, forced, lengths, n_valid, ex: ExecConfig):
    """`run_block` with every layer applied in turn to its own (unstacked) parameters."""
    per_run = [dict() for _ in block.runs]
    for g in range(block.repeats):
        for r, run in enumerate(block.runs):
            for i, li in enumerate(block.layer_grid(r)[g]):
                c = None if caches[r] is None else jax.tree.map(lambda x: x[g, i], caches[r])
                f = None if forced[r] is None else forced[r][g, i]
                gdef, p = nnx.split(layers[li])
                h, c, idx, extra = _layer_fn(gdef, ex)(p, h, c, f, lengths, n_valid)
                per_run[r][(g, i)] = (c, idx, extra)
    new_c, idxs, extras = [], [], []
    for r, run in enumerate(block.runs):
        slots = [(g, i) for g in range(block.repeats) for i in range(run.n)]
        c, idx, extra = (list(v) for v in zip(*(per_run[r][s] for s in slots)))
        cache = caches[r]
        if cache is not None:  # in-place slot updates of the incoming stacked cache
            for (g, i), v in zip(slots, c):
                cache = jax.tree.map(lambda b, x: b.at[g, i].set(x.astype(b.dtype)), cache, v)
        new_c.append(cache if cache is not None else _stack(c, block.repeats, run.n))
        idxs.append(_stack(idx, block.repeats, run.n))
        extras.append(_stack(extra, block.repeats, run.n))
    return h, tuple(new_c), tuple(idxs), tuple(extras)


def per_layer(block: Block, r: int, stacked_value):
    """{layer index: value} from a run's stacked [repeats, n, ...] output."""
    grid = block.layer_grid(r)
    return {li: stacked_value[g, i] for g, row in enumerate(grid) for i, li in enumerate(row)}


def stack_forced(block: Block, r: int, forced: dict | None):
    if forced is None or block.runs[r].moe is False:
        return None
    grid = block.layer_grid(r)
    return _stack([forced[li] for row in grid for li in row], block.repeats, len(grid[0]))

