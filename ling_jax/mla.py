"""Gated Multi-head Latent Attention (spec §10).

The cache holds only the normalised latent `c` [kv_lora_rank] and the rotated shared key `k_pe`
[qk_rope_head_dim] per token. Two equivalent attention forms read it:
`mla_expanded_attention` up-projects keys/values per head (cheap when the key set is the prompt
itself) and `mla_absorbed_attention` folds `W_UK` into the query and `W_UV` after the softmax,
i.e. multi-query attention over the 576-wide latent (decode, and prefill against a long cache).
Both are causal and mask keys beyond each sequence's length.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.exec_config import ExecConfig
from ling_jax.kv_quant import FP8, dequantize_per_token, quantize_per_token
from ling_jax.linear import Linear, TableRows, reads_in_place, table_kernel
from ling_jax.norms import RMSNorm
from ling_jax.ops import einsum, real_tokens
from ling_jax.rope import apply_rope, rope_parameters, softmax_scale
from ling_jax.kernel_mesh import on_mesh
from ling_jax.placement import param_mesh
from pallas_kernels._common import backend_platform
from pallas_kernels.mla import cpu_kernel
from pallas_kernels.mla.blockwise import blockwise_expanded_attention, blockwise_latent_attention, up_projection
from pallas_kernels.mla.kernel import latent_attention_pallas
from pallas_kernels.mla.paged import paged_latent_attention_pallas
from pallas_kernels.mla.reference import attention_mask, gather_pages, latent_attention, masked_softmax

log = logging.getLogger(__name__)


class MLACache(NamedTuple):
    """Per-layer latent cache. c: [B,S,kv_lora_rank]; k_pe: [B,S,rope_dim] (after RoPE). An FP8 cache
    (`ling_jax.kv_quant`) stores both as float8_e4m3fn with float32 per-token scales c_scale,
    k_pe_scale [B,S]; otherwise those are None."""
    c: jax.Array
    k_pe: jax.Array
    c_scale: Optional[jax.Array] = None
    k_pe_scale: Optional[jax.Array] = None
    #: None: the arrays are this layer's own. (g, j): they are a run's stacked cache [repeats, n, B, S, ...]
    #: and this layer is [g, j] of it (`ling_jax.layer_stack`: read and written in place, not sliced out)
    layer: Optional[tuple] = None


class PagedMLACache(NamedTuple):
    """Per-layer latent cache kept in fixed-size pages shared by many sequences (the serving engine).

    c_pages: [n_pages, P, kv_lora_rank]; kpe_pages: [n_pages, P, rope_dim] (after RoPE);
    block_table: [B, max_blocks] int32, page of block j of sequence b (token position p of b lives
    at page block_table[b, p // P], offset p % P). Why pages: a sequence holds only the pages its
    length needs, so many sequences of different lengths share one pool without one max_len buffer
    each. Entries past a sequence's length may name any page: they are masked by length.
    The engine stores pools with `block_table=None` and fills it in per call.
    An FP8 pool (`ling_jax.kv_quant`, the engine's `kv_cache_dtype="fp8"`) stores c_pages / kpe_pages
    as float8_e4m3fn with float32 per-token scales c_scale_pages / kpe_scale_pages [n_pages, P]
    (written with the values, by the same scatter); otherwise those are None.
    """
    c_pages: jax.Array
    kpe_pages: jax.Array
    block_table: jax.Array
    #: None, or (g, j): the pages are a run's stacked pool [repeats, n, n_pages, P, ...] (see MLACache.layer)
    layer: Optional[tuple] = None
    c_scale_pages: Optional[jax.Array] = None
    kpe_scale_pages: Optional[jax.Array] = None


def _scatter_tokens(buf: jax.Array, layer, a: jax.Array, b: jax.Array, vals: jax.Array, a_end: int):
    """buf[(*layer,) a[i], b[i]] = vals[i] for the N entries of a, b [N] (a == a_end: dropped).
    One entry is padded with a dropped second one: XLA:CPU turns a one-index scatter into a
    dynamic-update-slice that copies the whole buffer (`ling_jax.rows`)."""
    vals = vals.astype(buf.dtype)
    if a.shape[0] == 1:
        a = jnp.concatenate([a, jnp.full((1,), a_end, a.dtype)])
        b = jnp.concatenate([b, jnp.zeros((1,), b.dtype)])
        vals = jnp.concatenate([vals, jnp.zeros_like(vals)])
    lead = () if layer is None else tuple(layer)
    return buf.at[lead + (a, b)].set(vals, mode="drop")


def paged_write(pages: jax.Array, new: jax.Array, block_table: jax.Array, pos: jax.Array, valid: jax.Array,
                layer=None):
    """Scatter new [B,T,X] into pages [n_pages,P,X] (or, with `layer` (g, j), into layer [g, j] of
    stacked pages [repeats, n, n_pages, P, X], in place) at the absolute positions pos [B,T]; tokens
    with valid [B,T] False (right padding, idle rows) are dropped, so they never touch any page."""
    lead = 0 if layer is None else 2
    n_pages, P = pages.shape[lead:lead + 2]
    blk = jnp.take_along_axis(block_table, jnp.clip(pos // P, 0, block_table.shape[1] - 1), axis=1)
    page = jnp.where(valid, blk, n_pages)  # out of range: dropped by the scatter
    return _scatter_tokens(pages, layer, page.reshape(-1), (pos % P).reshape(-1),
                           new.reshape((-1,) + new.shape[2:]), n_pages)


#: The pages of each sequence in order, [B, max_blocks·P, X] (a contiguous-cache view; [B, max_blocks·P]
#: for per-token scale pages), read from layer (g, j) of stacked pages when `layer` is given.
paged_gather = gather_pages


def _contiguous_write(buf: jax.Array, new: jax.Array, lengths: jax.Array, layer=None) -> jax.Array:
    """buf [B,S,...] with new [B,T,...] written at positions lengths[b] + t (or layer (g, j) of a
    stacked buf [repeats, n, B, S, ...], in place)."""
    if layer is None:
        write = jax.vmap(lambda b, x, start: jax.lax.dynamic_update_slice_in_dim(b, x.astype(b.dtype), start, axis=0))
        return write(buf, new, lengths)
    B, T = new.shape[:2]
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T)).reshape(-1)
    cols = (lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]).reshape(-1)  # past the end: dropped
    return _scatter_tokens(buf, layer, rows, cols, new.reshape((-1,) + new.shape[2:]), B)


def _layer_read(x: jax.Array, layer) -> jax.Array:
    return x if layer is None else x[layer[0], layer[1]]


def mla_zero_cache(cfg: LingConfig, batch: int, max_len: int, dtype, kv_cache_dtype: str = "auto") -> MLACache:
    """Zero cache in `dtype`, or ("fp8") float8 values + float32 per-token scales."""
    if kv_cache_dtype == "fp8":
        return MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), FP8),
                        jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), FP8),
                        jnp.ones((batch, max_len), jnp.float32), jnp.ones((batch, max_len), jnp.float32))
    return MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                    jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype))


def mla_expanded_attention(q_nope, q_pe, c, k_pe, w_kv_b, mask, scale, dtype):
    """Reference form (spec §10.4).

    q_nope [B,T,H,dn]; q_pe [B,T,H,dr]; c [B,S,r]; k_pe [B,S,dr]; w_kv_b [H*(dn+dv), r] (or the
    up-projection as a function, `up_projection`); mask [B,T,S]. Returns o [B,T,H,dv].
    """
    H, dn = q_nope.shape[2], q_nope.shape[3]
    kv = up_projection(w_kv_b)(c).reshape(c.shape[0], c.shape[1], H, -1)  # [B,S,H,dn+dv]
    k_nope, v = kv[..., :dn], kv[..., dn:]
    s = (einsum("bthd,bshd->bhts", q_nope, k_nope, dtype=jnp.float32)
         + einsum("bthd,bsd->bhts", q_pe, k_pe, dtype=jnp.float32)) * scale
    p = masked_softmax(s, mask[:, None]).astype(dtype)
    return einsum("bhts,bshd->bthd", p, v)


def mla_absorbed_attention(q_nope, q_pe, c, k_pe, w_kv_b, mask, scale, dtype, core=latent_attention,
                           row_multiple: int = 1):
    """Absorbed form (spec §10.6): same arguments and result as `mla_expanded_attention`; w_kv_b may
    also be a scanned layer's `linear.TableRows` of it (float32, XLA:CPU: `absorbed_kv_b`), whose W_UK
    and W_UV the native kernel reads per head in place.

    `core` computes the latent attention (the Pallas kernel or its XLA reference `latent_attention`).
    row_multiple: the query-through-W_UK matmul runs on B·T rows padded with zeros to a multiple of
    this when B·T is larger (the padding rows are dropped; decode steps of ≤ 16 rows are left as
    they are, they compile). Why: XLA:GPU's Triton GEMM fusion of that matmul with an
    FP8 W_UK's dequantisation finds no tiling for 24 rows (a speculative verify of 8 rows × 3
    tokens: "Couldn't find output tile sizes", `ling-jax aot --target h200x8`); 16-row multiples
    compile. `mla_attention` asks for 16 on GPU, 1 (no padding) elsewhere.
    """
    H, dn = q_nope.shape[2], q_nope.shape[3]
    B, T = q_nope.shape[:2]
    if isinstance(w_kv_b, TableRows):  # a scanned layer's kv_b_proj rows, read in place (`absorbed_kv_b`)
        t, stride = w_kv_b, w_kv_b.rows // H
        q_hat = table_kernel.table_heads_cpu(q_nope, t.table, t.base, H, stride, 0, dn, contract=True)
        c_hat = core(q_hat, q_pe, c, k_pe, mask, scale)
        return table_kernel.table_heads_cpu(c_hat, t.table, t.base, H, stride, dn, stride - dn, contract=False)
    w = w_kv_b.reshape(H, -1, w_kv_b.shape[-1])  # [H, dn+dv, r]
    w_uk, w_uv = w[:, :dn].astype(dtype), w[:, dn:].astype(dtype)
    n = B * T
    padded = -(-n // row_multiple) * row_multiple if n > row_multiple else n
    q_rows = q_nope.reshape(n, H, dn)
    if padded != n:
        q_rows = jnp.pad(q_rows, ((0, padded - n), (0, 0), (0, 0)))
    q_hat = einsum("nhd,hdr->nhr", q_rows, w_uk)[:n].reshape(B, T, H, -1)  # [B,T,H,r]
    c_hat = core(q_hat, q_pe, c, k_pe, mask, scale)
    return einsum("bthr,hdr->bthd", c_hat, w_uv)


def absorbed_kv_b(proj: Linear, dtype):
    """kv_b_proj as the absorbed form takes it: on XLA:CPU a scanned layer's float32 `TableRows` as
    they are (W_UK and W_UV read per head where they are stored, `table_heads_cpu`: XLA:CPU would copy
    the layer's slice of the stack first), else the (dequantised) matrix [H·(dn+dv), r]."""
    w = proj.weight.get_value()
    return w if reads_in_place(w, dtype) else proj.matrix(dtype)


#: Rows of the absorbed query projection on GPU are padded to a multiple of this (see
#: `mla_absorbed_attention`).
GPU_QUERY_ROW_MULTIPLE = 16


#: Queries per sequence up to which the XLA path keeps the dense score tensor (decode steps and
#: speculative verifies: [B,H,T,S] is then no bigger than one key block of a prefill chunk, and one
#: fused pass beats a loop over blocks).
DENSE_MAX_ROWS = 8


def uses_blockwise(n_queries: int, n_keys: int, block: int) -> bool:
    """Whether the XLA attention runs over key blocks (`pallas_kernels.mla.blockwise`): when there is
    more than one block of keys and more queries than a decode/verify step has."""
    return n_keys > block and n_queries > DENSE_MAX_ROWS


def native_attention_applies(ex: ExecConfig, *arrays, fp8_cache: bool = False) -> bool:
    """Whether the absorbed core runs the native CPU kernel (`pallas_kernels.mla.cpu_kernel`): asked
    for (`ex.native_attention`, XLA kernels), float32, built (a warning once when it cannot be), and
    not over an FP8 latent cache (`fp8_cache`).

    Why FP8 caches keep the XLA forms: the native core sums a query row's scores in another order in
    a call of <= 8 rows (dot products) than in prefill tiles (keys in lanes), so one position's output
    differs in its last bits between generate's whole-prompt prefill and the engine's chunks (<= 1.3e-6;
    XLA's dense core is row-invariant: 0). Float32 caches don't mind; an e4m3 latent rounds at ~6%
    steps, so such a bit now and then flips a quantised value of the next layer and moved logprobs
    2.4e-4. (The XLA forms do not remove the flips altogether: the chunked prefill's own float32
    rounding makes some, 1.1e-4 / 2.4e-4 on two CPU models; tests/test_kv_fp8.py bounds generate vs
    the engine by what a flip can do. tests/test_mla_cpu_kernel.py asserts the bit difference, so this
    choice is revisited if it goes.)"""
    if fp8_cache or not (ex.native_attention and ex.kernels == "xla"
                         and all(a.dtype == jnp.float32 for a in arrays)):
        return False
    if not cpu_kernel.available():
        if not _native_warned:
            _native_warned.append(True)
            log.warning("native CPU attention kernel unavailable, using the XLA forms: %s", cpu_kernel.load_error())
        return False
    return True


_native_warned: list = []


def mla_attention(form, q_nope, q_pe, c, k_pe, w_kv_b, q_pos, kv_len, scale, dtype, ex: ExecConfig, mesh=None,
                  fp8_cache: bool = False):
    """MLA attention in `form` ("expanded" | "absorbed") the way `ex` says: the Pallas latent kernel
    (absorbed, kernels="pallas"), the native CPU kernel (absorbed, `ex.native_attention`, float32),
    else the XLA blockwise form (over key blocks of `ex.attn_block`:
    memory of one block of scores, not [B,H,T,S]) or, for decode-sized T or a single block, the dense
    form. All equal (tests/test_mla_blockwise.py).

    q_nope [B,T,H,dn]; q_pe [B,T,H,dr]; c [B,S,r]; k_pe [B,S,dr]; w_kv_b [H*(dn+dv), r] (or its
    `linear.TableRows`, `absorbed_kv_b`; the expanded form up-projects from those in place too); q_pos
    [B,T] absolute positions; kv_len [B] valid keys; fp8_cache: c and k_pe were dequantised from an FP8 cache
    (`native_attention_applies`). Returns o [B,T,H,dv] in `dtype`.
    """
    T, S = q_nope.shape[1], c.shape[1]
    blockwise = uses_blockwise(T, S, ex.attn_block)
    if form == "expanded":
        if isinstance(w_kv_b, TableRows):  # up-projected by the native kernel over the stored rows: no slice
            w_kv_b = w_kv_b.apply
        if blockwise:
            return blockwise_expanded_attention(q_nope, q_pe, c, k_pe, w_kv_b, q_pos, kv_len, scale, dtype,
                                                ex.attn_block)
        return mla_expanded_attention(q_nope, q_pe, c, k_pe, w_kv_b, attention_mask(q_pos, S, kv_len), scale, dtype)
    if ex.kernels == "pallas" or native_attention_applies(ex, q_nope, c, k_pe, fp8_cache=fp8_cache):
        def core(qh, qp, c_, kp, _mask, sc):  # per device on its own heads on a mesh (kernel_mesh.on_mesh)
            if ex.kernels == "pallas":
                kern = partial(latent_attention_pallas, scale=sc, platform=ex.platform)
            else:  # the native CPU kernel (same arguments)
                kern = lambda qh, qp, c_, kp, kv, pos: cpu_kernel.latent_attention_cpu(qh, qp, c_, kp, pos, kv, sc)  # noqa: E731
            bthr, bsr = ("batch", None, "heads", None), ("batch", None, None)
            return on_mesh(kern, mesh, (bthr, bthr, bsr, bsr, ("batch",), ("batch", None)), bthr,
                           (qh, qp, c_, kp, kv_len, q_pos), heads=qh.shape[2])
        mask = None
    elif blockwise:
        core = lambda qh, qp, c_, kp, _mask, sc: blockwise_latent_attention(qh, qp, c_, kp, q_pos, kv_len, sc,
                                                                             ex.attn_block)
        mask = None
    else:
        core, mask = latent_attention, attention_mask(q_pos, S, kv_len)
    rows = GPU_QUERY_ROW_MULTIPLE if backend_platform(ex.platform) == "gpu" else 1
    return mla_absorbed_attention(q_nope, q_pe, c, k_pe, w_kv_b, mask, scale, dtype, core=core, row_multiple=rows)


class MultiheadLatentAttention(nnx.Module):
    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs):
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        qd = H * cfg.qk_head_dim
        # the latent down-projections are shared by all heads; the per-head up-projections, the
        # head-wise gate and the output projection carry a `heads` dimension
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, axes=("q_lora", "embed"), dtype=dtype, rngs=rngs)
            # eps hard-coded in the reference
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, axis="q_lora")
            self.q_b_proj = Linear(cfg.q_lora_rank, qd, axes=("heads", "q_lora"), dtype=dtype, rngs=rngs)
        else:
            self.q_proj = Linear(D, qd, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim, axes=("kv_lora", "embed"),
                                         dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype, axis="kv_lora")
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                axes=("heads", "kv_lora"), dtype=dtype, rngs=rngs)
        self.g_proj = Linear(D, H, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.dense = Linear(H * cfg.v_head_dim, D, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        inv_freq, af = rope_parameters(cfg)
        # plain floats, not arrays: NNX would otherwise treat them as state
        self.inv_freq, self.rope_factor, self.scale = tuple(map(float, inv_freq)), float(af), softmax_scale(cfg)

    def __call__(self, x, cache: MLACache | PagedMLACache | None, lengths, n_valid, ex: ExecConfig):
        """x: [B,T,D]; cache holds `lengths[b]` tokens already; `n_valid[b]` of the T are real.

        `ex.mla_form`: "expanded" | "absorbed" | "auto" (expanded when the key set is the new tokens
        only, i.e. a cache-free forward; absorbed otherwise); `ex.kernels`: the absorbed core and
        the FP8 matmul of quantised projections. Returns (out [B,T,D], new cache).
        cache=None means a cache-free forward over the T tokens (positions 0..T-1). A PagedMLACache
        gets the real new tokens scattered into their pages and attends over them: with
        kernels="pallas" (bf16/f32 pages), or the native CPU kernel (float32 pages,
        `ex.native_attention`), the paged kernel reads them in place by the block table;
        otherwise over the gathered pages (the same keys as a contiguous cache; padding is never written).
        """
        cfg = self.cfg
        B, T, _ = x.shape
        H, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, ex)), ex)
        else:
            q = self.q_proj(x, ex)
        q = q.reshape(B, T, H, dn + dr)
        kv = self.kv_a_proj_with_mqa(x, ex)
        c_new = self.kv_a_layernorm(kv[..., :cfg.kv_lora_rank])
        pos = lengths[:, None] + jnp.arange(T)[None, :]  # [B,T]
        q_pe = apply_rope(q[..., dn:], pos, self.inv_freq, self.rope_factor)
        kpe_new = apply_rope(kv[..., cfg.kv_lora_rank:], pos, self.inv_freq, self.rope_factor)
        form = ex.mla_form
        if cache is None:
            c_all, kpe_all, new_cache = c_new, kpe_new, None
            if form == "auto":
                form = "expanded"
        elif isinstance(cache, PagedMLACache):
            valid = real_tokens(n_valid, T)
            L, bt = cache.layer, cache.block_table
            if cache.c_scale_pages is not None:  # FP8 pages: per-token e4m3 + scale, dequantised on read
                (cq, cs), (kq, ks) = quantize_per_token(c_new), quantize_per_token(kpe_new)
                new_cache = cache._replace(c_pages=paged_write(cache.c_pages, cq, bt, pos, valid, L),
                                           kpe_pages=paged_write(cache.kpe_pages, kq, bt, pos, valid, L),
                                           c_scale_pages=paged_write(cache.c_scale_pages, cs, bt, pos, valid, L),
                                           kpe_scale_pages=paged_write(cache.kpe_scale_pages, ks, bt, pos, valid, L))
                c_all = dequantize_per_token(paged_gather(new_cache.c_pages, bt, L),
                                             paged_gather(new_cache.c_scale_pages, bt, L), x.dtype)
                kpe_all = dequantize_per_token(paged_gather(new_cache.kpe_pages, bt, L),
                                               paged_gather(new_cache.kpe_scale_pages, bt, L), x.dtype)
            else:
                cp = paged_write(cache.c_pages, c_new, bt, pos, valid, L)
                kp = paged_write(cache.kpe_pages, kpe_new, bt, pos, valid, L)
                new_cache = cache._replace(c_pages=cp, kpe_pages=kp)
                if form != "expanded" and (ex.kernels == "pallas" or native_attention_applies(ex, x, cp)):
                    # the kernel (Pallas on TPU/GPU, native on CPU) reads the pages in place
                    o = self._paged_kernel_attention(q[..., :dn], q_pe, cp, kp, bt, L, pos, lengths + n_valid, x.dtype,
                                                     ex)
                    return self._output(x, o, ex), new_cache
                c_all, kpe_all = paged_gather(cp, bt, L), paged_gather(kp, bt, L)
            if form == "auto":
                form = "absorbed"
        else:
            L = cache.layer
            if cache.c_scale is not None:  # FP8 cache: store per-token e4m3 + scale, attend to the decode
                (cq, cs), (kq, ks) = quantize_per_token(c_new), quantize_per_token(kpe_new)
                new_cache = cache._replace(c=_contiguous_write(cache.c, cq, lengths, L),
                                           k_pe=_contiguous_write(cache.k_pe, kq, lengths, L),
                                           c_scale=_contiguous_write(cache.c_scale, cs, lengths, L),
                                           k_pe_scale=_contiguous_write(cache.k_pe_scale, ks, lengths, L))
                c_all = dequantize_per_token(_layer_read(new_cache.c, L), _layer_read(new_cache.c_scale, L), x.dtype)
                kpe_all = dequantize_per_token(_layer_read(new_cache.k_pe, L), _layer_read(new_cache.k_pe_scale, L),
                                               x.dtype)
            else:
                new_cache = cache._replace(c=_contiguous_write(cache.c, c_new, lengths, L),
                                           k_pe=_contiguous_write(cache.k_pe, kpe_new, lengths, L))
                c_all, kpe_all = _layer_read(new_cache.c, L), _layer_read(new_cache.k_pe, L)
            if form == "auto":
                form = "absorbed"
        kv_len = lengths + n_valid
        fp8 = getattr(cache, "c_scale", None) is not None or getattr(cache, "c_scale_pages", None) is not None
        # kv_b_proj is read as a matrix (split into W_UK / W_UV by the absorbed form): an FP8-kept one is
        # dequantised here, in-graph (a transient of one layer), like the XLA twin of the FP8 matmul; a
        # scanned layer's float32 rows on XLA:CPU are read in place (`absorbed_kv_b`).
        o = mla_attention(form, q[..., :dn], q_pe, c_all.astype(x.dtype), kpe_all.astype(x.dtype),
                          absorbed_kv_b(self.kv_b_proj, x.dtype), pos, kv_len, self.scale, x.dtype, ex,
                          param_mesh(self.kv_b_proj.weight), fp8_cache=fp8)
        return self._output(x, o, ex), new_cache

    def _output(self, x, o, ex: ExecConfig):
        """The head-wise sigmoid gate and the output projection: o [B,T,H,dv] -> [B,T,D]."""
        gate = jax.nn.sigmoid(self.g_proj(x, ex).astype(jnp.float32)).astype(x.dtype)
        o = o * gate[..., None]
        return self.dense(o.reshape(x.shape[0], x.shape[1], -1), ex)

    def _paged_kernel_attention(self, q_nope, q_pe, c_pages, kpe_pages, block_table, layer, q_pos, kv_len, dtype,
                                ex: ExecConfig):
        """The absorbed form with its core the paged kernel (`paged_latent_attention_pallas`, or with XLA
        kernels on CPU the native `paged_latent_attention_cpu`): the keys are read from the pool (a scanned
        run's stacked pages, layer (g, j)) by the block table, never gathered into a [B, width·P, r] copy.
        Per device on its own heads on a mesh (the pages are replicated). Returns o [B,T,H,dv]."""
        mesh = param_mesh(self.kv_b_proj.weight)
        g, j = (jnp.zeros((), jnp.int32),) * 2 if layer is None else (jnp.asarray(i, jnp.int32) for i in layer)

        def core(qh, qp, _c, _kp, _mask, sc):
            def kern(qh, qp, cp, kp, bt, kv, qpos, g, j):
                at = None if layer is None else (g, j)
                if ex.kernels != "pallas":
                    return cpu_kernel.paged_latent_attention_cpu(qh, qp, cp, kp, bt, kv, qpos, sc, layer=at)
                return paged_latent_attention_pallas(qh, qp, cp, kp, bt, kv, qpos, sc, layer=at, platform=ex.platform)
            bthr = ("batch", None, "heads", None)
            return on_mesh(kern, mesh, (bthr, bthr, None, None, ("batch", None), ("batch",), ("batch", None), None,
                                        None), bthr, (qh, qp, c_pages, kpe_pages, block_table, kv_len, q_pos, g, j),
                           heads=qh.shape[2])

        rows = GPU_QUERY_ROW_MULTIPLE if backend_platform(ex.platform) == "gpu" else 1
        return mla_absorbed_attention(q_nope, q_pe.astype(dtype), None, None, absorbed_kv_b(self.kv_b_proj, dtype),
                                      None, self.scale, dtype, core=core, row_multiple=rows)
