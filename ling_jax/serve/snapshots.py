"""The prefix cache's device side: a pool of KDA snapshot rows and the two copy programs.

A snapshot row holds what a slot holds (pools.py) but the token statistics: per KDA layer the
recurrent and conv states, and the `hidden` row (the MTP layer's next input), laid out like the
slot pools ([repeats, n, rows, ...] per run). Snapshots inside a prefill chunk are written by the
prefill program itself (`step._save_boundaries`); the two programs here, of one shape each (C
copies per call, padding copies dropped by the scatter), take the others:
* `save(snaps, pools, slots [C], rows [C])`: slot rows -> snapshot rows (a chunk ended on a page);
* `restore(pools, snaps, rows, slots, dst, src)`: snapshot rows -> a hit's slot, and page src ->
  page dst in every MLA pool and the MTP pool (the copy-on-write of prefix_cache.py).
Copies are exact, so a restored slot holds bit for bit what the snapshot took.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ling_jax.config import LingConfig
from ling_jax.kda import kda_zero_state
from ling_jax.layer_stack import zeros_by_kind
from ling_jax.rows import put_rows, take_rows
from ling_jax.serve.allocator import PoolSizes
from ling_jax.serve.multihost import OP_RESTORE, OP_SAVE
from ling_jax.serve.pools import GIB, Pools, make_placed, pin_pools
from ling_jax.serve.prefix_cache import Restore

#: The default prefix-cache budget, as a fraction of the page pool's bytes. Why a fraction of the
#: pages: the cache's pages are pool pages (reclaimed on demand, so they cost running requests
#: nothing), while its snapshot rows are device memory of their own, sized from the same budget.
DEFAULT_BUDGET_FRACTION = 0.5


class Snapshots(NamedTuple):
    """layers: per block, per run: KDAState [repeats, n, rows, ...] for KDA runs, None for MLA runs;
    hidden: [rows, D]."""
    layers: tuple
    hidden: jax.Array


def init_snapshots(cfg: LingConfig, rows: int, dtype, conv_taps: bool = False) -> Snapshots:
    layers = zeros_by_kind(cfg, lambda: kda_zero_state(cfg, rows, dtype, taps=conv_taps), lambda: None)
    return Snapshots(layers, jnp.zeros((rows, cfg.hidden_size), dtype))


def plan_snapshots(sizes: PoolSizes, every: int, budget_gib: float | None) -> tuple[int, int]:
    """(budget bytes, snapshot rows). Budget: `budget_gib`, default DEFAULT_BUDGET_FRACTION of the
    page pool but at least one snapshot with its pages. Rows: one snapshot per `every` tokens' pages
    (the engine's min(prefill_chunk, snapshot_interval): how often a prefill takes one), so
    budget // (snapshot_bytes + every/page_size · page_bytes), at least 1."""
    chunk_pages = max(1, every // sizes.page_size)
    unit = sizes.snapshot_bytes + chunk_pages * sizes.page_bytes
    if budget_gib is None:
        budget = max(int(DEFAULT_BUDGET_FRACTION * sizes.num_pages * sizes.page_bytes), unit)
    else:
        if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or not budget_gib > 0:
            raise ValueError(f"prefix_cache_memory_gib must be a number > 0, got {budget_gib!r}")
        budget = int(budget_gib * GIB)
    least = sizes.snapshot_bytes + sizes.page_bytes
    if budget < least:
        raise ValueError(f"prefix_cache_memory_gib={budget / GIB:.6g} does not cover one snapshot "
                         f"({sizes.snapshot_bytes} B) plus one page ({sizes.page_bytes} B); give more, "
                         f"or prefix_cache=False")
    return budget, max(1, budget // unit)


def _put(dst, src, dst_idx, src_idx, axis: int):
    """dst with dst[..., dst_idx[i], ...] = src[..., src_idx[i], ...] along `axis` (out-of-range
    dst_idx dropped)."""
    return put_rows(dst, dst_idx, take_rows(src, src_idx, axis), axis)


def _save(snaps: Snapshots, pools: Pools, slots, rows) -> Snapshots:
    layers = tuple(tuple(None if s is None else jax.tree.map(lambda d, x: _put(d, x, rows, slots, 2), s, p)
                         for s, p in zip(sb, pb)) for sb, pb in zip(snaps.layers, pools.layers))
    return Snapshots(layers, _put(snaps.hidden, pools.hidden, rows, slots, 0))


_PAGE_FIELDS = ("c_pages", "kpe_pages", "c_scale_pages", "kpe_scale_pages")


def _copy_pages(p, dst, src, axis: int):
    """A PagedMLACache with pages src copied onto pages dst in every page array it has (values and,
    in an FP8 pool, their per-token scales)."""
    return p._replace(**{f: _put(getattr(p, f), getattr(p, f), dst, src, axis)
                         for f in _PAGE_FIELDS if getattr(p, f) is not None})


def _restore(pools: Pools, snaps: Snapshots, rows, slots, dst, src) -> Pools:
    def run(p, s):
        if s is not None:  # a KDA run: the slot rows
            return jax.tree.map(lambda x, y: _put(x, y, slots, rows, 2), p, s)
        return _copy_pages(p, dst, src, 2)

    layers = tuple(tuple(run(p, s) for p, s in zip(pb, sb)) for pb, sb in zip(pools.layers, snaps.layers))
    mtp = pools.mtp
    if mtp is not None:
        mtp = _copy_pages(mtp, dst, src, 0)
    return pools._replace(layers=layers, mtp=mtp, hidden=_put(pools.hidden, snaps.hidden, slots, rows, 0))


class SnapshotPool:
    """The snapshot rows on the device and the two copy programs (R = `copies` per call).

    `save(pools, [(slot, row)])` and `restore(pools, [Restore]) -> pools` take the host cache's
    orders (prefix_cache.PrefixCache.after_prefill / take_restores) and run them, padded to R."""

    def __init__(self, cfg: LingConfig, sizes: PoolSizes, rows: int, dtype, copies: int, placement,
                 pool_sharding=None, abstract: bool = False, conv_taps: bool = False):
        """placement(snaps) -> the rows' shardings (the engine's: split by head like the slot pools);
        pool_sharding: the pools' declared shardings, fixed as the restore program's output (as every
        step program's, `step.make_step_fns`), so no step sees a new signature after a hit; conv_taps:
        the conv states as the pools keep them (`pools.init_pools`)."""
        self.sizes, self.rows, self.copies = sizes, rows, copies
        self.link = None  # multi-host: the engine's StepLink; every copy is broadcast before it runs
        self.snaps, self.sharding = make_placed(lambda: init_snapshots(cfg, rows, dtype, conv_taps), placement,
                                                 abstract)
        # fresh function objects per pool (jit caches live on the function: `compiled_shapes()` counts
        # this engine's programs only); out_shardings: one spelling of the rows' placement for every
        # producer of the rows (as `step.make_step_fns`), so no call sees a new signature after warm-up
        self._save = jax.jit(lambda snaps, pools, slots, rows: _save(snaps, pools, slots, rows), donate_argnums=(0,),
                             out_shardings=self.sharding, **pin_pools(pool_sharding, 4, at=1))
        self._restore = jax.jit(lambda pools, snaps, rows, slots, dst, src:
                                _restore(pools, snaps, rows, slots, dst, src),
                                donate_argnums=(0,), out_shardings=pool_sharding, **pin_pools(pool_sharding, 6, at=0))

    @property
    def bytes(self) -> int:
        return self.rows * self.sizes.snapshot_bytes

    def compiled_shapes(self) -> int:
        return self._save._cache_size() + self._restore._cache_size()

    @property
    def index_words(self) -> int:
        """int32 words of the largest copy order (restore: 4 index arrays of `copies`)."""
        return 4 * self.copies

    def _index(self, values, pad: int) -> np.ndarray:
        out = np.full(self.copies, pad, np.int32)
        out[:len(values)] = values
        return out

    def _save_index(self, copies) -> tuple:
        """(slots, rows) of one padded save call over [(slot, row)]."""
        return self._index([s for s, _ in copies], self.sizes.max_slots), self._index([r for _, r in copies], self.rows)

    def _restore_index(self, ops: list[Restore]) -> tuple:
        """(rows, slots, dst, src) of one padded restore call."""
        S, NP = self.sizes.max_slots, self.sizes.num_pages
        return (self._index([o.snapshot for o in ops], self.rows), self._index([o.slot for o in ops], S),
                self._index([o.dst_page for o in ops], NP), self._index([o.src_page for o in ops], NP))

    def run_save(self, pools: Pools, slots: np.ndarray, rows: np.ndarray) -> None:
        """One padded save call (every process of a multi-host run makes it, see `follow`)."""
        if self.link is not None and self.link.is_leader:
            self.link.send(OP_SAVE, np.concatenate([slots, rows]))
        self.snaps = self._save(self.snaps, pools, slots, rows)

    def run_restore(self, pools: Pools, rows, slots, dst, src) -> Pools:
        """One padded restore call."""
        if self.link is not None and self.link.is_leader:
            self.link.send(OP_RESTORE, np.concatenate([rows, slots, dst, src]))
        return self._restore(pools, self.snaps, rows, slots, dst, src)

    def follow(self, pools: Pools, op: int, words: np.ndarray) -> Pools:
        """A follower's copy of the leader's `run_save` / `run_restore` call from its words."""
        c = self.copies
        if op == OP_SAVE:
            self.run_save(pools, words[:c], words[c:2 * c])
            return pools
        return self.run_restore(pools, *(words[i * c:(i + 1) * c] for i in range(4)))

    def save(self, pools: Pools, copies) -> None:
        """Run the host cache's (slot, row) copies, `copies` per padded call."""
        for i in range(0, len(copies), self.copies):
            self.run_save(pools, *self._save_index(copies[i:i + self.copies]))

    def restore(self, pools: Pools, ops: list[Restore]) -> Pools:
        """Run the host cache's restore orders, `copies` per padded call."""
        for i in range(0, len(ops), self.copies):
            pools = self.run_restore(pools, *self._restore_index(ops[i:i + self.copies]))
        return pools

    def program_calls(self, pools: Pools) -> list:
        """[(name, jitted program, arguments)] of the two copy programs on the warm-up's padding copies."""
        c = self.copies
        return [(f"snapshot-save[C={c}]", self._save, (self.snaps, pools) + self._save_index([])),
                (f"snapshot-restore[C={c}]", self._restore, (pools, self.snaps) + self._restore_index([]))]

    def warmup(self, pools: Pools) -> Pools:
        """Run both programs on padding copies (they change nothing)."""
        self.run_save(pools, *self._save_index([]))
        return self.run_restore(pools, *self._restore_index([]))
