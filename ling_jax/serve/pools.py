"""The serving engine's device memory: sequence slots and latent-cache pages, as explicit pytrees.

Two kinds of memory, sized once at start-up (nothing is allocated per request):

* **Slots** (`max_slots`): row s of every KDA layer's recurrent state [H,dk,dv] f32 and three conv
  states [K-1, H·dk], and of `hidden` (the last processed token's final-normed hidden, the MTP
  layer's next input). KDA memory is length-independent, so a slot is all a sequence needs of it.
* **Pages** (`num_pages` × `page_size` tokens): every MLA layer (and the MTP layer's) keeps its
  latent `c` [kv_lora_rank] and rotated key `k_pe` [rope_dim] in one page pool per layer; a
  sequence owns a list of pages (its block table row), so a short sequence holds few pages and
  many lengths share one pool. All layers share one page numbering: page i of every layer's pool
  belongs to the same sequence, hence one block table serves all layers.

The pools are stacked like the model's cache (`HybridCache`: per block of `layer_plan`, per run,
arrays `[repeats, n, ...]`), so `as_cache` turns them into the cache the model consumes without
copying the pools. `PageAllocator` is the host-side bookkeeping of which slot owns which pages.
Byte counts use the arithmetic of `ling_jax.accounting.cache_bytes`.
"""
from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ling_jax.accounting import cache_bytes
from ling_jax.config import KDA, LingConfig
from ling_jax.kda import kda_zero_state
from ling_jax.layer_stack import map_runs, zeros_by_kind
from ling_jax.mla import PagedMLACache
from ling_jax.model import HybridCache
from ling_jax.rows import put_rows, take_rows
from ling_jax.serve.token_stats import TokenStats, init_token_stats, stats_bytes_per_slot
from sharding.rules import path_str, spec

GIB = 1024 ** 3


class Pools(NamedTuple):
    """layers: per block, per run: KDAState with arrays [repeats, n, max_slots, ...] or
    PagedMLACache (block_table None) with pages [repeats, n, num_pages, page_size, ...];
    mtp: the MTP layer's PagedMLACache [num_pages, page_size, ...] or None;
    hidden: [max_slots, D] final-normed hidden of each slot's last processed token;
    stats: per-slot token statistics for the penalties (`token_stats.TokenStats`)."""
    layers: tuple
    mtp: Optional[PagedMLACache]
    hidden: jax.Array
    stats: Optional[TokenStats] = None


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """How many slots and pages, and what they cost. `max_blocks` = pages one sequence may hold
    (ceil(max_seq_len / page_size)): the width of the block table."""
    max_slots: int
    page_size: int
    num_pages: int
    max_seq_len: int
    with_mtp: bool
    page_bytes: int
    slot_bytes: int
    stats_bytes: int = 0  # of slot_bytes: the token statistics (not part of a prefix-cache snapshot)

    @property
    def snapshot_bytes(self) -> int:
        """What a prefix-cache snapshot row holds of a slot: KDA state + conv state + hidden."""
        return self.slot_bytes - self.stats_bytes

    @property
    def max_blocks(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.max_slots * self.slot_bytes


def _byte_costs(cfg: LingConfig, dtype, with_mtp: bool) -> tuple[int, int, dict]:
    """(bytes of one page across all MLA pools, bytes of one slot across all KDA layers, cache_bytes)."""
    item = jnp.dtype(dtype).itemsize
    cb = cache_bytes(cfg, cache_dtype_bytes=item, state_dtype_bytes=4, conv_dtype_bytes=item)
    per_token = cb["mla_bytes_per_token_with_mtp"] if with_mtp else cb["mla_bytes_per_token"]
    slot = (cb["kda_state_bytes_per_sequence"] + cb["kda_conv_state_bytes_per_sequence"]
            + cfg.hidden_size * item + stats_bytes_per_slot(cfg.vocab_size))
    return per_token, slot, cb


def plan_pools(cfg: LingConfig, dtype, *, max_slots: int, page_size: int, num_pages: int | None = None,
               cache_memory_gib: float | None = None, max_seq_len: int | None = None,
               with_mtp: bool = True) -> PoolSizes:
    """Sizes from either `num_pages` or a cache memory budget (slots are paid first, the rest
    becomes pages). max_seq_len (prompt + generated tokens of one request) defaults to the
    smaller of the model's context and the whole pool."""
    for name, v in (("max_slots", max_slots), ("page_size", page_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    with_mtp = bool(with_mtp and cfg.has_mtp)
    per_token, slot, _ = _byte_costs(cfg, dtype, with_mtp)
    page = per_token * page_size
    if (num_pages is None) == (cache_memory_gib is None):
        raise ValueError("give exactly one of num_pages or cache_memory_gib")
    if num_pages is None:
        if not cache_memory_gib > 0:
            raise ValueError(f"cache_memory_gib must be > 0, got {cache_memory_gib!r}")
        budget = int(cache_memory_gib * GIB) - max_slots * slot
        if budget < page:
            raise ValueError(f"cache_memory_gib={cache_memory_gib} does not cover {max_slots} slots "
                             f"({max_slots * slot} bytes) plus one page ({page} bytes)")
        num_pages = budget // page
    if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
        raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    max_seq_len = max_seq_len or min(cfg.max_position_embeddings, num_pages * page_size)
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    return PoolSizes(max_slots, page_size, num_pages, max_seq_len, with_mtp, page, slot,
                     stats_bytes_per_slot(cfg.vocab_size))


def describe(cfg: LingConfig, sizes: PoolSizes, dtype) -> str:
    """The start-up report: what the pools hold and the arithmetic of their size."""
    per_token, slot, cb = _byte_costs(cfg, dtype, sizes.with_mtp)
    n_mla = cb["num_mla_layers"] + (1 if sizes.with_mtp else 0)
    pages = sizes.num_pages * sizes.page_bytes
    slots = sizes.max_slots * sizes.slot_bytes
    return "\n".join([
        f"cache pools ({jnp.dtype(dtype).name} latents, float32 KDA state):",
        f"  pages: {sizes.num_pages} x {sizes.page_size} tokens x {n_mla} MLA layers"
        f"{' (incl. MTP)' if sizes.with_mtp else ''} x {cb['mla_bytes_per_token_per_layer']} B/token/layer"
        f" = {pages / GIB:.4f} GiB ({sizes.num_pages * sizes.page_size} tokens in all)",
        f"  slots: {sizes.max_slots} x ({cb['num_kda_layers']} KDA layers x "
        f"({cb['kda_state_bytes_per_sequence_per_layer']} B state + "
        f"{cb['kda_conv_state_bytes_per_sequence_per_layer']} B conv) + {cfg.hidden_size * jnp.dtype(dtype).itemsize} B hidden"
        f" + {stats_bytes_per_slot(cfg.vocab_size)} B token stats (int32 counts + bool prompt mask x {cfg.vocab_size}"
        f" vocab, for the penalties)) = {slots / GIB:.4f} GiB",
        f"  total {sizes.total_bytes / GIB:.4f} GiB; one request holds at most {sizes.max_seq_len} tokens "
        f"({sizes.max_blocks} pages)",
    ])


def init_pools(cfg: LingConfig, sizes: PoolSizes, dtype) -> Pools:
    """Zero pools (zero pages are finite, so a masked key never turns into NaN)."""
    S, NP, P = sizes.max_slots, sizes.num_pages, sizes.page_size

    def paged():
        return PagedMLACache(jnp.zeros((NP, P, cfg.kv_lora_rank), dtype),
                             jnp.zeros((NP, P, cfg.qk_rope_head_dim), dtype), None)

    layers = zeros_by_kind(cfg, lambda: kda_zero_state(cfg, S, dtype), paged)
    return Pools(layers, paged() if sizes.with_mtp else None, jnp.zeros((S, cfg.hidden_size), dtype),
                 init_token_stats(S, cfg.vocab_size))


def pool_shardings(cfg: LingConfig, tree, mesh):
    """NamedShardings on `mesh` for `Pools` or `snapshots.Snapshots` (declared where they are made).

    KDA recurrent states [..., rows, H, dk, dv] and conv states [..., rows, K-1, H·dk] are split by
    head over the mesh's `model` axis, like the KDA projections that compute them (each device
    keeps the states of its own heads: no gather in a step, and 1/model of the bytes). Everything
    else is replicated: the MLA and MTP latent pages (one KV head shared by all heads, read by every
    device), `hidden`, the token statistics. The slot / row axis is never split: a step gathers
    arbitrary rows. Heads that do not divide evenly leave that axis replicated (`sharding.rules.spec`)."""
    heads = cfg.num_attention_heads

    def one(path, x):
        name = path_str(path)
        if name.endswith("recurrent"):
            axes = (None,) * (x.ndim - 3) + ("heads", None, None)
        elif re.search(r"conv_[qkv]$", name):
            axes = (None,) * (x.ndim - 1) + ("heads",)
        else:
            axes = (None,) * x.ndim
        return NamedSharding(mesh, spec(axes, x.shape, mesh, heads, where=f"pools/{name}"))
    return jax.tree_util.tree_map_with_path(one, tree)


def placed_like(cfg: LingConfig, tree, params):
    """The shardings `tree` (Pools or Snapshots) gets next to the parameters: `pool_shardings` on
    their mesh when they live on one (a NamedSharding), else their single device for every leaf."""
    sh = jax.tree.leaves(params)[0].sharding
    if isinstance(sh, NamedSharding):
        return pool_shardings(cfg, tree, sh.mesh)
    return jax.tree.map(lambda _: sh, tree)


def is_abstract(tree) -> bool:
    """True when `tree`'s leaves are ShapeDtypeStructs (a compile-only model's parameters, `ling_jax.aot`)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and isinstance(leaves[0], jax.ShapeDtypeStruct)


def make_placed(make, placement, abstract: bool = False):
    """(tree, shardings): `make()`'s zeros put where `placement(tree)` says, or, `abstract`, only their
    shapes with those shardings (nothing allocated: compile-only devices hold no data)."""
    if not abstract:
        tree = make()
        sharding = placement(tree)
        return jax.device_put(tree, sharding), sharding
    shapes = jax.eval_shape(make)
    sharding = placement(shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, sharding), sharding


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a placed pytree (a split axis counts its shard only)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard, dtype=np.int64)) * x.dtype.itemsize
    return total


def as_cache(cfg: LingConfig, pools: Pools, block_table: jax.Array, lengths: jax.Array,
             rows: jax.Array | None = None, fresh: jax.Array | None = None) -> HybridCache:
    """The HybridCache the model reads, for the slot rows `rows` [R] (None: every slot).

    fresh [R] bool: rows starting a new sequence in a reused slot: their KDA state reads as zero
    (what the slot's previous owner left is never seen).
    KDA states of the rows are gathered (an index of the pool equal to max_slots marks a padding
    row: clipped on read, dropped on write by `with_cache`); MLA layers get their whole page pool
    plus block_table [R, max_blocks], one table for all layers: the layer stack hands each MLA
    layer its run's whole stacked pool with the layer's index, and the layer reads and writes its
    own pages in place (`ling_jax.layer_stack`)."""
    def one(run, c):
        if run.attn != KDA:
            return c._replace(block_table=block_table)
        return c if rows is None else jax.tree.map(lambda x: take_rows(x, rows, axis=2), c)

    layers = map_runs(cfg, one, pools.layers)
    mtp = None if pools.mtp is None else pools.mtp._replace(block_table=block_table)
    # fresh rows are zeroed as each layer reads its state (`HybridCache.fresh`): a select over the
    # whole slot pool here would be a pool-sized copy in every step
    return HybridCache(layers, mtp, lengths, fresh)


def with_cache(cfg: LingConfig, pools: Pools, cache: HybridCache, rows: jax.Array | None = None) -> Pools:
    """Pools updated from the cache a model call returned (inverse of `as_cache`): KDA rows
    scattered back (padding rows, index max_slots, dropped), page pools taken as they are."""
    def one(run, old, new):
        if run.attn != KDA:
            return new._replace(block_table=None)
        return new if rows is None else jax.tree.map(lambda o, n: put_rows(o, rows, n, axis=2), old, new)

    layers = map_runs(cfg, one, pools.layers, cache.layers)
    mtp = None if cache.mtp is None else cache.mtp._replace(block_table=None)
    return pools._replace(layers=layers, mtp=mtp)


class PageAllocator:
    """Host-side page bookkeeping: which slots hold which pages (in block order), and which are free.

    Deterministic (a LIFO list of empty pages), so a run is reproducible. `ensure(slot, n_tokens)`
    grows a slot to hold n_tokens, all or nothing; `release(slot)` gives its pages back.

    With a prefix cache (`cache`, a `prefix_cache.PrefixCache`) a page may be held by several slots
    (a cached prefix shared by reference: `refs[p]` counts the slots holding p) and by the cache
    (`cached`). A cached page the cache could evict (its tree node unlocked: no running request
    uses it) counts as free: `ensure` takes empty pages first and otherwise evicts the cache's
    least recently used leaves, so cached pages are reclaimed before anything is preempted.
    """

    def __init__(self, sizes: PoolSizes):
        self.sizes = sizes
        self.empty = list(range(sizes.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.pages: dict[int, list[int]] = {}
        self.refs = [0] * sizes.num_pages
        self.cached: set[int] = set()
        self.cache = None  # set by PrefixCache: evict_one() / evictable / evictable_pages()

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.sizes.page_size)

    @property
    def num_free(self) -> int:
        """Pages a slot could get now: empty ones plus cached ones the prefix cache can evict."""
        return len(self.empty) + (self.cache.evictable if self.cache is not None else 0)

    @property
    def free(self) -> list[int]:
        """The free pages (empty, then evictable cached ones); a list for checks, see num_free."""
        return self.empty + (self.cache.evictable_pages() if self.cache is not None else [])

    def ensure(self, slot: int, n_tokens: int) -> bool:
        have = self.pages.setdefault(slot, [])
        need = self.pages_for(n_tokens) - len(have)
        if need > self.num_free:
            return False
        for _ in range(max(need, 0)):
            if not self.empty and not self.cache.evict_one():
                raise AssertionError("page accounting out of step: no empty page and nothing to evict")
            p = self.empty.pop()
            assert self.refs[p] == 0 and p not in self.cached, p
            self.refs[p] = 1
            have.append(p)
        return True

    def share(self, slot: int, pages) -> None:
        """Start the (empty) slot with pages another holder keeps too: a cached prefix."""
        if self.pages.get(slot):
            raise AssertionError(f"slot {slot} already holds pages")
        self.pages[slot] = list(pages)
        for p in pages:
            self.refs[p] += 1

    def release(self, slot: int) -> None:
        for p in reversed(self.pages.pop(slot, [])):
            self.refs[p] -= 1
            if self.refs[p] == 0 and p not in self.cached:
                self.empty.append(p)

    def cache_page(self, page: int) -> None:
        """The prefix cache keeps `page` (it stays allocated when its slots release it)."""
        self.cached.add(page)

    def uncache_page(self, page: int) -> None:
        """The prefix cache dropped `page`; it is empty again once no slot holds it."""
        self.cached.remove(page)
        if self.refs[page] == 0:
            self.empty.append(page)

    @property
    def used(self) -> int:
        return self.sizes.num_pages - self.num_free

    def block_rows(self, slots) -> np.ndarray:
        """[len(slots), max_blocks] int32 block table rows (unused entries 0: masked by length)."""
        out = np.zeros((len(slots), self.sizes.max_blocks), np.int32)
        for i, s in enumerate(slots):
            if s is not None:
                p = self.pages.get(s, [])
                out[i, :len(p)] = p
        return out
