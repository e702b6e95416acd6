"""Paged absorbed-MLA attention that reads the latent pages where they lie; reference:
`mla.reference.paged_latent_attention` (= `gather_pages` + `latent_attention`).

Why: the serving engine keeps every sequence's latent cache in fixed-size pages of a shared pool
(`ling_jax.mla.PagedMLACache`). Gathering a row's pages into a contiguous [B, nb·P, r] copy before
attending costs a read and a write of every page of the block table, and temporaries that grow with
the table's width, per MLA layer and step. This kernel follows the block table instead: each grid step
(TPU) or loop iteration (GPU) fetches the next pages of the row straight from the pool, so a decode
step reads the pages its rows hold keys in, once, and writes nothing but the [rows, r] result.

The pool may be one layer's [n_pages, P, w] or a scanned run's stacked [repeats, n, n_pages, P, w]
with `layer` = (g, j) traced indices (the layer scan's carry: read in place, never sliced out).
The math is the flash-decoding block update of `mla.kernel` (`_update`: online softmax, the mask
as a per-row limit), over keys that arrive a page at a time.

* TPU (mode "grid"): grid (batch, row-block, split, step); the block table, the per-row key limit
  and the layer index are scalar-prefetch operands (SMEM), and each step's `pages_per_step` pages are
  delivered by BlockSpec pipelining with an index map that looks the page up in the table (the same
  pool passed once per page slot of a step, so one step attends over pages_per_step·P keys). Steps
  past a row's last visible key repeat the last page index: Pallas skips the copy of a block whose
  index did not change, and the compute is skipped (`pl.when`), so bytes read grow with the tokens
  cached, not with the table width.
* GPU / Triton (mode "loop"): grid (batch, row-block, split); each program walks its share of the
  table with `fori_loop`, loading each page by its number (a pointer offset into the pool, no copy) and
  skipping pages past the limit with `lax.cond`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import compiler_params, next_pow2, target
from pallas_kernels.mla.kernel import GPU_SMS, _update, init_state, key_loop, merge_splits, query_rows, row_blocks

F32 = jnp.float32
#: TPU: bytes of block table one grid call scalar-prefetches into SMEM (1 MiB on v5p; the other
#: prefetched operands are a few hundred bytes). A wider batch x table is run in row groups.
SMEM_TABLE_BYTES = 512 * 1024


def _grid_kernel(bt_ref, lim_b_ref, layer_ref, q_ref, qpe_ref, lim_ref, *refs, scale, page, pages_per_step,
                 steps_per_split):
    del bt_ref, layer_ref  # used by the index maps only
    k = pages_per_step
    c_refs, kpe_refs, (acc_ref, m_ref, l_ref) = refs[:k], refs[k:2 * k], refs[2 * k:]
    b, p, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _():
        init_state(m_ref, l_ref, acc_ref)

    start = (p * steps_per_split + i) * (k * page)

    @pl.when(start < lim_b_ref[b])
    def _():
        c = c_refs[0][...] if k == 1 else jnp.concatenate([r[...] for r in c_refs], axis=0)  # [k·P, r]
        kpe = kpe_refs[0][...] if k == 1 else jnp.concatenate([r[...] for r in kpe_refs], axis=0)
        m, l, acc = _update(q_ref[...], qpe_ref[...], c, kpe, lim_ref[...], start, None,
                            (m_ref[...], l_ref[...], acc_ref[...]), scale)
        m_ref[...] = m
        l_ref[...] = l
        acc_ref[...] = acc


def _loop_kernel(bt_ref, layer_ref, q_ref, qpe_ref, lim_ref, c_ref, kpe_ref, acc_ref, m_ref, l_ref, *, scale, page,
                 pages_per_split, stacked):
    b, p = pl.program_id(0), pl.program_id(2)
    lim = lim_ref[...]
    max_lim = jnp.max(lim)
    q, qpe = q_ref[...], qpe_ref[...]
    bq, r = q.shape
    lead = (layer_ref[0], layer_ref[1]) if stacked else ()

    def upd(i, carry):
        blk = p * pages_per_split + i
        idx = lead + (bt_ref[b, blk], slice(None), slice(None))
        return _update(q, qpe, c_ref[idx], kpe_ref[idx], lim, blk * page, None, carry, scale)

    key_loop(pages_per_split, lambda i: (p * pages_per_split + i) * page < max_lim, upd, bq, r,
             (acc_ref, m_ref, l_ref))


def _defaults(mode, pages_per_step, num_splits, block_q, B, rows, plat):
    if mode is None:
        mode = "grid" if plat == "tpu" else "loop"
    if pages_per_step is None:
        pages_per_step = 8 if plat == "tpu" else 1  # TPU: 8 pages of 16 = 128 keys per step (one lane tile)
    if block_q is None and plat == "gpu":
        block_q = 32
    if num_splits is None:
        row_blocks = -(-rows // (block_q or min(256, next_pow2(max(rows, 16)))))
        num_splits = 1 if plat != "gpu" else max(1, GPU_SMS // max(B * row_blocks, 1))
    return mode, pages_per_step, num_splits, block_q


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "mode", "pages_per_step", "num_splits", "block_q",
                                             "plat"))
def _run(q_hat, q_pe, c_pages, kpe_pages, block_table, kv_len, q_pos, layer, scale, interpret, mode, pages_per_step,
         num_splits, block_q, plat):
    B, T, H, r = q_hat.shape
    dr = q_pe.shape[-1]
    stacked = c_pages.ndim == 5
    P = c_pages.shape[-2]
    nb = block_table.shape[1]
    bq, Rp, nq = row_blocks(T * H, block_q)
    q2, qpe2, lim_rows = query_rows(q_hat, q_pe, kv_len, q_pos, Rp)
    layer = jnp.zeros((2,), jnp.int32) if layer is None else jnp.stack([jnp.asarray(x, jnp.int32) for x in layer])
    block_table = block_table.astype(jnp.int32)
    lead = (None, None) if stacked else ()

    q_specs = [pl.BlockSpec((None, bq, w), lambda b, qi, s, *_: (b, qi, 0)) for w in (r, dr, 1)]
    out_specs = [pl.BlockSpec((None, None, bq, w), lambda b, qi, s, *_: (b, s, qi, 0)) for w in (r, 1, 1)]
    if mode == "grid":
        k = max(1, min(pages_per_step, nb))
        n_steps = -(-nb // k)
        S = max(1, min(num_splits, n_steps))
        sps = -(-n_steps // S)
        out_shape = [jax.ShapeDtypeStruct((B, S, Rp, w), F32) for w in (r, 1, 1)]
        lim_b = jnp.max(lim_rows[..., 0], axis=1)  # [B] keys any row of the sequence can see

        def page_spec(w, m):
            def index(b, qi, s, i, bt, lb, lay):
                last = jnp.maximum(jax.lax.div(lb[b] + P - 1, P) - 1, 0)  # last table entry with visible keys
                blk = jnp.minimum(jnp.minimum((s * sps + i) * k + m, last), nb - 1)  # clamped: no new copy
                pg = bt[b * nb + blk]
                return (lay[0], lay[1], pg, 0, 0) if stacked else (pg, 0, 0)
            return pl.BlockSpec(lead + (None, P, w), index)

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(B, nq, S, sps),
            in_specs=q_specs + [page_spec(r, m) for m in range(k)] + [page_spec(dr, m) for m in range(k)],
            out_specs=out_specs)
        kernel = functools.partial(_grid_kernel, scale=scale, page=P, pages_per_step=k, steps_per_split=sps)
        acc, m, l = pl.pallas_call(
            kernel, grid_spec=grid_spec, out_shape=out_shape, interpret=interpret, name="mla_paged",
            compiler_params=compiler_params(interpret, plat, ("parallel", "parallel", "parallel", "arbitrary")),
        )(block_table.reshape(-1), lim_b, layer, q2, qpe2, lim_rows, *([c_pages] * k), *([kpe_pages] * k))
    elif mode == "loop":
        S = max(1, min(num_splits, nb))
        pps = -(-nb // S)
        if pps * S != nb:  # whole splits; the extra entries are past every row's keys (masked, not loaded)
            block_table = jnp.pad(block_table, ((0, 0), (0, pps * S - nb)))
        out_shape = [jax.ShapeDtypeStruct((B, S, Rp, w), F32) for w in (r, 1, 1)]
        whole = pl.BlockSpec(memory_space=pl.ANY) if plat == "tpu" else pl.BlockSpec()
        kernel = functools.partial(_loop_kernel, scale=scale, page=P, pages_per_split=pps, stacked=stacked)
        acc, m, l = pl.pallas_call(
            kernel, grid=(B, nq, S),
            in_specs=[whole, whole] + q_specs + [whole, whole],
            out_specs=out_specs, out_shape=out_shape, interpret=interpret, name="mla_paged",
            compiler_params=compiler_params(interpret, plat, num_warps=8, num_stages=2),
        )(block_table, layer, q2, qpe2, lim_rows, c_pages, kpe_pages)
    else:
        raise ValueError(f"mode must be 'grid' or 'loop', got {mode!r}")
    return merge_splits(acc, m, l, q_hat)


def paged_latent_attention_pallas(q_hat, q_pe, c_pages, kpe_pages, block_table, kv_len, q_pos, scale, layer=None,
                                  interpret=None, *, mode: str | None = None, pages_per_step: int | None = None,
                                  num_splits: int | None = None, block_q: int | None = None,
                                  platform: str | None = None, smem_table_bytes: int = SMEM_TABLE_BYTES):
    """Absorbed-MLA core over a paged cache, read in place; equals `paged_latent_attention` (its reference).

    q_hat [B,T,H,r]; q_pe [B,T,H,dr]; c_pages [n_pages, P, r], kpe_pages [n_pages, P, dr] (or a scanned
    run's [repeats, n, n_pages, P, ...] with `layer` (g, j), int scalars, possibly traced); block_table
    [B, nb] int32; kv_len [B] valid keys; q_pos [B,T] absolute query positions. Returns c_hat [B,T,H,r].
    Table entries past a row's keys may name any page (they are neither read nor computed).

    mode: "grid" (TPU default) | "loop" (GPU default); pages_per_step: pages per TPU grid step (8);
    num_splits: parallel partitions of the table (flash decoding; GPU ⌊132 / programs⌋, else 1);
    block_q: query rows per program (GPU 32; else the rows rounded up to a power of two ≥ 16, ≤ 256).
    smem_table_bytes (grid mode): the block table is scalar-prefetched into SMEM, so a batch whose
    table is larger runs in groups of rows, one call each (the real config at 64 rows x 5,559 pages
    needed 1.42 MB of the v5p's 1 MiB SMEM: the compiler refused it).
    """
    plat, interpret = target(platform, interpret)
    B = q_hat.shape[0]
    mode, pages_per_step, num_splits, block_q = _defaults(mode, pages_per_step, num_splits, block_q, B,
                                                          q_hat.shape[1] * q_hat.shape[2], plat)
    run = functools.partial(_run, layer=layer, scale=float(scale), interpret=interpret, mode=mode,
                            pages_per_step=pages_per_step, num_splits=num_splits, block_q=block_q, plat=plat)
    group = max(1, smem_table_bytes // (4 * block_table.shape[1])) if mode == "grid" else B
    if group >= B:
        return run(q_hat, q_pe, c_pages, kpe_pages, block_table, kv_len, q_pos)
    return jnp.concatenate([run(q_hat[i:i + group], q_pe[i:i + group], c_pages, kpe_pages, block_table[i:i + group],
                                kv_len[i:i + group], q_pos[i:i + group]) for i in range(0, B, group)], axis=0)
