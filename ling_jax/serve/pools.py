"""The serving engine's device memory: sequence slots and latent-cache pages, as explicit pytrees.

Sized once at start-up (nothing is allocated per request): **slots** (`max_slots`), row s of every
KDA layer's recurrent and conv states, of `hidden` (the MTP layer's next input) and of the token
statistics (KDA memory is length-independent, so a slot is all a sequence needs of it); **pages**
(`num_pages` x `page_size` tokens) of every MLA layer's (and the MTP layer's) latent `c` and `k_pe`,
one numbering for all layers, so one block table serves them all. The pools are stacked like the
model's cache (`HybridCache`: per run of `layer_plan`, `[repeats, n, ...]`), so `as_cache` hands
them to the model without a copy. Sizes and the host bookkeeping: allocator.py; the byte
arithmetic: `accounting.cache_bytes`; the layout and placement rules: serve/README.md, *Memory*.
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding

from ling_jax.accounting import cache_bytes
from ling_jax.checks import check_int
from ling_jax.config import KDA, LingConfig
from ling_jax.kda import CONV_FIELDS, KDAState, SlotKDAState, conv_like, kda_zero_state
from ling_jax.kv_quant import FP8, check_kv_cache_dtype
from ling_jax.layer_stack import map_runs, zeros_by_kind
from ling_jax.mla import PagedMLACache
from ling_jax.model import HybridCache
from ling_jax.rows import put_rows, take_rows
from ling_jax.serve.allocator import PoolSizes
from ling_jax.token_stats import TokenStats, init_token_stats, stats_bytes_per_slot
from sharding.rules import path_str, spec

GIB = 1024 ** 3


class Pools(NamedTuple):
    """layers: per block, per run: KDAState [repeats, n, max_slots, ...] or PagedMLACache (block_table
    None) [repeats, n, num_pages, page_size, ...]; mtp: the MTP layer's PagedMLACache or None;
    hidden [max_slots, D]: each slot's last final-normed hidden; stats: `token_stats.TokenStats`."""
    layers: tuple
    mtp: Optional[PagedMLACache]
    hidden: jax.Array
    stats: Optional[TokenStats] = None


def _byte_costs(cfg: LingConfig, dtype, with_mtp: bool, kv_cache_dtype: str = "auto") -> tuple[int, int, dict]:
    """(bytes of one token's page entries across all MLA pools, bytes of one slot across all KDA
    layers, cache_bytes)."""
    item = jnp.dtype(dtype).itemsize
    cb = cache_bytes(cfg, cache_dtype_bytes=item, state_dtype_bytes=4, conv_dtype_bytes=item,
                     kv_cache_dtype=kv_cache_dtype)
    per_token = cb["mla_bytes_per_token_with_mtp"] if with_mtp else cb["mla_bytes_per_token"]
    slot = (cb["kda_state_bytes_per_sequence"] + cb["kda_conv_state_bytes_per_sequence"]
            + cfg.hidden_size * item + stats_bytes_per_slot(cfg.vocab_size))
    return per_token, slot, cb


def stored_kpe_values(cfg: LingConfig, exec, dtype, kv_cache_dtype: str | None = None) -> int:
    """Values a token's k_pe row takes in the pools: dr, or dr rounded up to 128 lanes where the pools
    keep k_pe row-major on TPU (`token_row_formats`)."""
    dr = cfg.qk_rope_head_dim
    kv = check_kv_cache_dtype(kv_cache_dtype)
    dtype = FP8 if kv == "fp8" else dtype
    if exec.pool_layout != "token_rows" or not _row_major_tiles(exec.platform or jax.default_backend(), dtype):
        return dr
    return -(-dr // 128) * 128


def plan_pools(cfg: LingConfig, dtype, *, max_slots: int, page_size: int, num_pages: int | None = None,
               cache_memory_gib: float | None = None, max_seq_len: int | None = None,
               with_mtp: bool = True, kv_cache_dtype: str | None = None, kpe_stored: int | None = None) -> PoolSizes:
    """Sizes from `num_pages` or a cache memory budget (slots paid first, the rest becomes pages).
    max_seq_len defaults to the smaller of the model's context and the whole pool. kv_cache_dtype:
    "auto"/None (pages in `dtype`) or "fp8" (float8 + two float32 scales per token: ~1.97x the tokens
    per GiB of bf16). kpe_stored: a k_pe row's stored values (`stored_kpe_values`; None = dr)."""
    for name, v in (("max_slots", max_slots), ("page_size", page_size)):
        check_int(v, name, low=1)
    kv = check_kv_cache_dtype(kv_cache_dtype)
    with_mtp = bool(with_mtp and cfg.has_mtp)
    per_token, slot, cb = _byte_costs(cfg, dtype, with_mtp, kv)
    pad = max(0, (kpe_stored or cfg.qk_rope_head_dim) - cfg.qk_rope_head_dim)
    per_token += pad * jnp.dtype(dtype).itemsize * (cb["num_mla_layers"] + (1 if with_mtp else 0))
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
    check_int(num_pages, "num_pages", low=1)
    max_seq_len = max_seq_len or min(cfg.max_position_embeddings, num_pages * page_size)
    check_int(max_seq_len, "max_seq_len", low=2)
    return PoolSizes(max_slots, page_size, num_pages, max_seq_len, with_mtp, page, slot,
                     stats_bytes_per_slot(cfg.vocab_size), kv, cfg.qk_rope_head_dim + pad if pad else 0)


def describe(cfg: LingConfig, sizes: PoolSizes, dtype) -> str:
    """The start-up report: what the pools hold and the arithmetic of their size."""
    per_token, slot, cb = _byte_costs(cfg, dtype, sizes.with_mtp, sizes.kv_cache_dtype)
    n_mla = cb["num_mla_layers"] + (1 if sizes.with_mtp else 0)
    pages = sizes.num_pages * sizes.page_bytes
    slots = sizes.max_slots * sizes.slot_bytes
    latents = ("float8_e4m3fn latents + float32 per-token scales" if sizes.kv_cache_dtype == "fp8"
               else f"{jnp.dtype(dtype).name} latents")
    per_layer, padded = cb["mla_bytes_per_token_per_layer"], ""
    if sizes.kpe_stored:
        per_layer = sizes.page_bytes // (sizes.page_size * n_mla)
        padded = f" (k_pe rows stored row-major as {sizes.kpe_stored} values: ExecConfig.pool_layout)"
    return "\n".join([
        f"cache pools ({latents}, float32 KDA state):",
        f"  pages: {sizes.num_pages} x {sizes.page_size} tokens x {n_mla} MLA layers"
        f"{' (incl. MTP)' if sizes.with_mtp else ''} x {per_layer} B/token/layer{padded}"
        f" = {pages / GIB:.4f} GiB ({sizes.num_pages * sizes.page_size} tokens in all)",
        f"  slots: {sizes.max_slots} x ({cb['num_kda_layers']} KDA layers x "
        f"({cb['kda_state_bytes_per_sequence_per_layer']} B state + "
        f"{cb['kda_conv_state_bytes_per_sequence_per_layer']} B conv) + {cfg.hidden_size * jnp.dtype(dtype).itemsize} B hidden"
        f" + {stats_bytes_per_slot(cfg.vocab_size)} B token stats (int32 counts + bool prompt mask x {cfg.vocab_size}"
        f" vocab, for the penalties)) = {slots / GIB:.4f} GiB",
        f"  total {sizes.total_bytes / GIB:.4f} GiB; one request holds at most {sizes.max_seq_len} tokens "
        f"({sizes.max_blocks} pages)",
    ])


def init_pools(cfg: LingConfig, sizes: PoolSizes, dtype, conv_taps: bool = False) -> Pools:
    """Zero pools (zero pages are finite, so a masked key never turns into NaN). conv_taps: the KDA
    conv windows kept as lane-dense taps (`kda.conv_taps`; `ExecConfig.pool_layout="token_rows"`, TPU)."""
    S, NP, P = sizes.max_slots, sizes.num_pages, sizes.page_size

    def paged():
        if sizes.kv_cache_dtype == "fp8":  # zero values with unit scales: a masked key stays finite
            return PagedMLACache(jnp.zeros((NP, P, cfg.kv_lora_rank), FP8), jnp.zeros((NP, P, cfg.qk_rope_head_dim), FP8),
                                 None, None, jnp.ones((NP, P), jnp.float32), jnp.ones((NP, P), jnp.float32))
        return PagedMLACache(jnp.zeros((NP, P, cfg.kv_lora_rank), dtype),
                             jnp.zeros((NP, P, cfg.qk_rope_head_dim), dtype), None)

    layers = zeros_by_kind(cfg, lambda: kda_zero_state(cfg, S, dtype, taps=conv_taps), paged)
    return Pools(layers, paged() if sizes.with_mtp else None, jnp.zeros((S, cfg.hidden_size), dtype),
                 init_token_stats(S, cfg.vocab_size))


def pool_shardings(cfg: LingConfig, tree, mesh):
    """NamedShardings on `mesh` for `Pools` or `snapshots.Snapshots` (declared where they are made):
    KDA recurrent states [..., rows, H, dk, dv] and conv states ([..., rows, K-1, H·dk] or taps
    [..., rows, H·dk]) split by head over `model`, like the KDA projections that compute them (no
    gather in a step, 1/model of the bytes); the rest replicated (the latent pages: one KV head read
    by every device; `hidden`; the token statistics). The row axis is never split (a step gathers
    arbitrary rows); heads that do not divide leave that axis replicated (`sharding.rules.spec`)."""
    heads = cfg.num_attention_heads

    def one(path, x):
        name = path_str(path)
        if name.endswith("recurrent"):
            axes = (None,) * (x.ndim - 3) + ("heads", None, None)
        elif re.search(r"conv_[qkv](/\d+)?$", name):  # a window [.., K-1, C] or its taps [.., C]
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
    """(tree, shardings): `make()`'s zeros put where `placement(tree)` says (shardings or `Format`s),
    or, `abstract`, only their shapes with those shardings (compile-only devices hold no data)."""
    if not abstract:
        tree = make()
        sharding = placement(tree)
        return jax.device_put(tree, sharding), sharding
    shapes = jax.eval_shape(make)
    sharding = placement(shapes)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                        shardings_of(sharding)), sharding


def shardings_of(tree):
    """The shardings of a tree of shardings or `Format`s (a Format's sharding; a sharding as is)."""
    return jax.tree.map(lambda s: s.sharding if isinstance(s, Format) else s, tree)


def pin_pools(pool_sharding, n_args: int, at: int = 1) -> dict:
    """`jax.jit` keyword arguments fixing argument `at` (the pools) of an `n_args`-argument program to
    `pool_sharding` when it carries layouts (`token_row_formats`), so the program reads the pools in
    their stored layout (unpinned it is compiled for the default one and the call refused); else {}."""
    if pool_sharding is None or not any(isinstance(s, Format) for s in jax.tree.leaves(pool_sharding)):
        return {}
    return {"in_shardings": tuple(pool_sharding if i == at else None for i in range(n_args))}


#: TPU tiles of a row-major array by element type (what XLA:TPU assigns such an array; a Format with
#: another tiling is overridden and refused by jax).
_TPU_TILES = {jnp.dtype(jnp.bfloat16): ((8, 128), (2, 1)), jnp.dtype(jnp.float32): ((8, 128),)}


def _row_major_tiles(platform: str, dtype):
    """The tiling of a row-major k_pe pool of `dtype` on `platform` (TPU: padded to 128 lanes), () where
    row-major is untiled (CPU, GPU), None where a TPU type has no known tiling (the default kept)."""
    if platform != "tpu":
        return ()
    return _TPU_TILES.get(jnp.dtype(dtype))


def token_row_formats(pools, shardings):
    """`ExecConfig.pool_layout="token_rows"`: the k_pe page pools (`*/kpe_pages`, [..., n_pages, P,
    dr]) as row-major `Format`s (each token's dr values minor: the layout the paged write and the
    attention kernels use), every other leaf its plain sharding. Why: XLA:TPU keeps an array whose
    minor dimension is 64 values (half a 128-lane tile) with another dimension minor, so each k_pe
    pool was copied into row-major and back in every step (2x its temp memory and traffic,
    tests/test_aot.py); row-major pads dr = 64 to 128 lanes (+11% of the latent pages at r = 512)
    and no program copies it. On CPU and GPU row-major is the default."""
    def one(path, x, s):
        if not path_str(path).endswith("kpe_pages"):
            return s
        tiles = _row_major_tiles(next(iter(s.device_set)).platform, x.dtype)
        if tiles is None:
            return s
        return Format(Layout(major_to_minor=tuple(range(x.ndim)), tiling=tiles), s)
    return jax.tree_util.tree_map_with_path(one, pools, shardings)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a placed pytree (a split axis counts its shard only)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard, dtype=np.int64)) * x.dtype.itemsize
    return total


def as_cache(cfg: LingConfig, pools: Pools, block_table: jax.Array, lengths: jax.Array,
             rows: jax.Array | None = None, fresh: jax.Array | None = None, in_place: bool = False) -> HybridCache:
    """The HybridCache the model reads for the slot rows `rows` [R] (None: every slot). KDA states
    of the rows are gathered (index max_slots = a padding row: clipped on read, dropped on write by
    `with_cache`); fresh [R] bool: rows starting a new sequence in a reused slot, whose KDA state
    reads as zero. MLA layers get their whole page pool and block_table [R, max_blocks], one for all
    layers: each reads and writes its own pages in place (`ling_jax.layer_stack`). in_place: the KDA
    recurrent states stay in the slot pool (`kda.SlotKDAState`, `kda.kda_in_place`); only the rows'
    conv states are gathered."""
    def one(run, c):
        if run.attn != KDA:
            return c._replace(block_table=block_table)
        got = c if rows is None else jax.tree.map(lambda x: take_rows(x, rows, axis=2), c._replace(recurrent=None))
        if in_place:
            slots = jnp.arange(c.recurrent.shape[2], dtype=jnp.int32) if rows is None else rows
            return SlotKDAState(c.recurrent, got.conv_q, got.conv_k, got.conv_v, slots, fresh)
        return c if rows is None else got._replace(recurrent=take_rows(c.recurrent, rows, axis=2))

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
        new = conv_like(new, old)  # conv windows (a verify's rollback) as the pools' taps
        put = lambda o, n: put_rows(o, rows, n, axis=2)  # noqa: E731
        if isinstance(new, SlotKDAState):  # the recurrent pool came back updated in place
            new = KDAState(new.recurrent, new.conv_q, new.conv_k, new.conv_v)
            if rows is None:
                return new
            return KDAState(new.recurrent, *(jax.tree.map(put, getattr(old, f), getattr(new, f)) for f in CONV_FIELDS))
        return new if rows is None else jax.tree.map(put, old, new)

    layers = map_runs(cfg, one, pools.layers, cache.layers)
    mtp = None if cache.mtp is None else cache.mtp._replace(block_table=None)
    return pools._replace(layers=layers, mtp=mtp)
