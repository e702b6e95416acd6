"""Flash-decoding Pallas kernel for absorbed MLA (spec §10.6); reference: `mla.reference.latent_attention`.

Multi-query attention over the latent cache: every query row (token t, head h) of width
r + dr = 512 + 64 attends to the shared keys [c ; k_pe] and reads values c. The T·H query rows of
a sequence are one matrix (decode: 64 rows), so each key block costs two MXU/tensor-core matmuls
(scores) and one (values) for all heads at once.

* Split-K ("flash decoding"): the key axis is cut into `num_splits` partitions that run as
  parallel programs, each keeping an online-softmax state (running max m, sum l, accumulator);
  the partials are merged by log-sum-exp in XLA (a [B, splits, rows, r] float32 tensor, small
  next to the cache).
* Masking is the reference's `attention_mask(q_pos, S, kv_len)`: key τ is visible to row (t, h) iff
  τ < min(q_pos[t] + 1, kv_len). The wrapper precomputes that per-row limit, so the kernel masks
  with one vector compare; key blocks at or beyond the largest limit of the sequence are skipped
  (no compute; on TPU also no DMA, see "grid" mode).
* Two drivers share the block update:
  - mode="grid" (TPU default): grid (batch, row-block, split, key-block), key blocks delivered by
    BlockSpec pipelining, m/l/acc accumulated in the resident output blocks across the
    "arbitrary" key-block axis. The per-sequence limit is a scalar-prefetch operand (SMEM) that
    clamps the block index, so blocks past the valid length are never copied from HBM.
  - mode="loop" (GPU/Triton default): grid (batch, row-block, split), each program loops over its
    key blocks with `fori_loop` + `lax.cond` (blocks past the limit are neither loaded nor
    computed). The cache is padded to a multiple of block_s if it is not one already (a copy:
    allocate the cache with such a length to avoid it).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import NEG, compiler_params, dot, next_pow2, target

F32 = jnp.float32


def _update(q, qpe, c, kpe, lim, start, seq_len, carry, scale):
    """Online-softmax step over one key block. q [bq,r]; qpe [bq,dr]; c [bs,r]; kpe [bs,dr];
    lim [bq,1] int32; start: first key position of the block; seq_len: static S (rows ≥ S are
    out-of-bounds padding and are zeroed). carry = (m [bq,1], l [bq,1], acc [bq,r]) float32."""
    m, l, acc = carry
    bs = c.shape[0]
    if seq_len is not None:
        kcol = start + jax.lax.broadcasted_iota(jnp.int32, (bs, 1), 0)
        c = jnp.where(kcol < seq_len, c, jnp.zeros_like(c))
        kpe = jnp.where(kcol < seq_len, kpe, jnp.zeros_like(kpe))
    c = c.astype(q.dtype)
    s = (dot(q, c, trans_b=True) + dot(qpe, kpe.astype(qpe.dtype), trans_b=True)) * scale  # [bq,bs]
    kpos = start + jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)
    mask = kpos < lim
    s = jnp.where(mask, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + dot(p.astype(c.dtype), c)
    return m_new, l, acc


def _grid_kernel(lim_b_ref, q_ref, qpe_ref, lim_ref, c_ref, kpe_ref, acc_ref, m_ref, l_ref, *, scale, block_s,
                 blocks_per_split, seq_len):
    b, p, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _():
        init_state(m_ref, l_ref, acc_ref)

    start = (p * blocks_per_split + i) * block_s

    @pl.when(start < lim_b_ref[b])
    def _():
        m, l, acc = _update(q_ref[...], qpe_ref[...], c_ref[...], kpe_ref[...], lim_ref[...], start, seq_len,
                            (m_ref[...], l_ref[...], acc_ref[...]), scale)
        m_ref[...] = m
        l_ref[...] = l
        acc_ref[...] = acc


def _loop_kernel(q_ref, qpe_ref, lim_ref, c_ref, kpe_ref, acc_ref, m_ref, l_ref, *, scale, block_s,
                 blocks_per_split):
    p = pl.program_id(2)
    lim = lim_ref[...]
    max_lim = jnp.max(lim)
    q, qpe = q_ref[...], qpe_ref[...]
    bq, r = q.shape

    def upd(i, carry):
        start = (p * blocks_per_split + i) * block_s
        keys = pl.ds(pl.multiple_of(start, block_s), block_s)
        return _update(q, qpe, c_ref[keys, :], kpe_ref[keys, :], lim, start, None, carry, scale)

    key_loop(blocks_per_split, lambda i: (p * blocks_per_split + i) * block_s < max_lim, upd, bq, r,
             (acc_ref, m_ref, l_ref))


def init_state(m_ref, l_ref, acc_ref):
    """The online-softmax state at its start: m = NEG, l = 0, acc = 0 (the grid drivers' first key step)."""
    m_ref[...] = jnp.full(m_ref.shape, NEG, F32)
    l_ref[...] = jnp.zeros(l_ref.shape, F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, F32)


def key_loop(n: int, visible, update, bq: int, r: int, out_refs):
    """The loop drivers' body: `fori_loop` over n key blocks, block i folded in by update(i, carry) when
    visible(i) (else skipped: neither loaded nor computed), then (acc, m, l) written to out_refs."""
    def body(i, carry):
        return jax.lax.cond(visible(i), lambda cr: update(i, cr), lambda cr: cr, carry)

    init = (jnp.full((bq, 1), NEG, F32), jnp.zeros((bq, 1), F32), jnp.zeros((bq, r), F32))
    m, l, acc = jax.lax.fori_loop(0, n, body, init)
    acc_ref, m_ref, l_ref = out_refs
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


GPU_SMS = 132  # H100 / H200


def _defaults(mode, block_s, num_splits, block_q, B, plat: str, rows: int = 1):
    """rows: query rows per sequence (T·H). GPU splits fill the SMs counting every parallel program: B
    sequences x row blocks x splits. Why not B alone: a prefill chunk (T = 64, H = 64: 128 row blocks)
    already fills them, and 66 splits there wrote 1.1 GB of float32 partials for a 2 x 64 chunk
    (`tools/aot_kernels.py`, h200: temp 1072 MiB -> see BENCHMARKS "Compile-only")."""
    if mode is None:
        mode = "grid" if plat == "tpu" else "loop"
    if block_s is None:
        block_s = {"tpu": 512, "gpu": 64}.get(plat, 128)
    if block_q is None and plat == "gpu":
        block_q = 32  # [32, 512] f32 accumulator per program: fits the register file with 8 warps
    if num_splits is None:
        row_blocks = -(-rows // (block_q or min(256, next_pow2(max(rows, 16)))))
        num_splits = 1 if plat != "gpu" else max(1, GPU_SMS // max(B * row_blocks, 1))
    return mode, block_s, num_splits, block_q


@functools.partial(jax.jit, static_argnames=("plat", "scale", "block_s", "interpret", "num_splits", "block_q", "mode"))
def _run(q_hat, q_pe, c, k_pe, kv_len, q_pos, scale, block_s, interpret, num_splits, block_q, mode, plat):
    B, T, H, r = q_hat.shape
    dr = q_pe.shape[-1]
    S = c.shape[1]
    bq, Rp, nq = row_blocks(T * H, block_q)
    bs = block_s
    nb = -(-S // bs)
    P = max(1, min(num_splits, nb))
    nbp = -(-nb // P)

    q2, qpe2, lim_rows = query_rows(q_hat, q_pe, kv_len, q_pos, Rp)

    out_shape = [jax.ShapeDtypeStruct((B, P, Rp, w), F32) for w in (r, 1, 1)]  # acc, m, l
    # Query rows and the outputs: the same blocks in both modes (grid indices b, qi, p first; the grid
    # mode's key-block index and scalar prefetch follow).
    q_specs = [pl.BlockSpec((None, bq, w), lambda b, qi, p, *_: (b, qi, 0)) for w in (r, dr, 1)]
    out_specs = [pl.BlockSpec((None, None, bq, w), lambda b, qi, p, *_: (b, p, qi, 0)) for w in (r, 1, 1)]
    if mode == "grid":
        lim_b = jnp.max(lim_rows[..., 0], axis=1)  # [B] keys any row of the sequence can see

        def key_block(b, p, i, lim_b):
            last = jnp.maximum(jax.lax.div(lim_b[b] + bs - 1, bs) - 1, 0)  # last block with visible keys (lim ≥ 0)
            return jnp.minimum(jnp.minimum(p * nbp + i, last), nb - 1)  # clamped: repeated index, no DMA

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, nq, P, nbp),
            in_specs=q_specs + [pl.BlockSpec((None, bs, w), lambda b, qi, p, i, lb: (b, key_block(b, p, i, lb), 0))
                                for w in (r, dr)],
            out_specs=out_specs)
        kernel = functools.partial(_grid_kernel, scale=scale, block_s=bs, blocks_per_split=nbp,
                                   seq_len=S if S % bs else None)
        acc, m, l = pl.pallas_call(
            kernel, grid_spec=grid_spec, out_shape=out_shape, interpret=interpret, name="mla_decode",
            compiler_params=compiler_params(interpret, plat, ("parallel", "parallel", "parallel", "arbitrary")),
        )(lim_b, q2, qpe2, lim_rows, c, k_pe)
    elif mode == "loop":
        Sp = nb * bs
        if Sp != S:  # a copy of the cache; allocate it with a length that is a multiple of block_s
            c = jnp.pad(c, ((0, 0), (0, Sp - S), (0, 0)))
            k_pe = jnp.pad(k_pe, ((0, 0), (0, Sp - S), (0, 0)))
        kernel = functools.partial(_loop_kernel, scale=scale, block_s=bs, blocks_per_split=nbp)
        acc, m, l = pl.pallas_call(
            kernel, grid=(B, nq, P),
            in_specs=q_specs + [pl.BlockSpec((None, Sp, w), lambda b, qi, p: (b, 0, 0)) for w in (r, dr)],
            out_specs=out_specs,
            out_shape=out_shape, interpret=interpret, name="mla_decode",
            compiler_params=compiler_params(interpret, plat, num_warps=8, num_stages=2),
        )(q2, qpe2, lim_rows, c, k_pe)
    else:
        raise ValueError(f"mode must be 'grid' or 'loop', got {mode!r}")

    return merge_splits(acc, m, l, q_hat)


def row_blocks(rows: int, block_q: int | None):
    """(rows per block, rows padded to whole blocks, blocks) of a T·H query matrix: block_q, or the rows
    rounded up to a power of two ≥ 16 and at most 256."""
    bq = block_q or min(256, next_pow2(max(rows, 16)))
    padded = -(-rows // bq) * bq
    return bq, padded, padded // bq


def query_rows(q_hat, q_pe, kv_len, q_pos, rows_padded: int):
    """The kernels' query matrix: (q [B,Rp,r], q_pe [B,Rp,dr], lim [B,Rp,1] int32), row t·H + h, zero rows
    up to Rp. lim: keys τ < lim are visible to the row (τ ≤ q_pos and τ < kv_len: `attention_mask`)."""
    B, T, H, r = q_hat.shape
    R, dr = T * H, q_pe.shape[-1]
    lim_t = jnp.minimum(q_pos.astype(jnp.int32) + 1, kv_len.astype(jnp.int32)[:, None])  # [B,T]
    lim_rows = jnp.repeat(jnp.maximum(lim_t, 0), H, axis=1)  # row = t*H + h
    q2, qpe2 = q_hat.reshape(B, R, r), q_pe.reshape(B, R, dr)
    if rows_padded != R:
        q2 = jnp.pad(q2, ((0, 0), (0, rows_padded - R), (0, 0)))
        qpe2 = jnp.pad(qpe2, ((0, 0), (0, rows_padded - R), (0, 0)))
        lim_rows = jnp.pad(lim_rows, ((0, 0), (0, rows_padded - R)))
    return q2, qpe2, lim_rows[..., None]


def merge_splits(acc, m, l, q_hat):
    """Log-sum-exp merge of the key splits' partials acc [B,splits,Rp,r], m, l [B,splits,Rp,1] into
    c_hat [B,T,H,r] (q_hat's shape and dtype); a row that saw no key gives 0, as the reference."""
    B, T, H, r = q_hat.shape
    mx = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - mx)
    num = jnp.sum(w * acc, axis=1)
    den = jnp.sum(w * l, axis=1)
    out = num / jnp.where(den > 0, den, 1.0)
    return out[:, :T * H].reshape(B, T, H, r).astype(q_hat.dtype)


def latent_attention_pallas(q_hat, q_pe, c, k_pe, kv_len, q_pos, scale, block_s: int | None = None, interpret=None,
                            *, num_splits: int | None = None, block_q: int | None = None, mode: str | None = None,
                            platform: str | None = None):
    """Absorbed-MLA core; equals `latent_attention(q_hat, q_pe, c, k_pe, attention_mask(q_pos, S, kv_len), scale)`.

    q_hat [B,T,H,r]; q_pe [B,T,H,dr]; c [B,S,r]; k_pe [B,S,dr]; kv_len [B] valid cache length;
    q_pos [B,T] absolute query positions. Returns c_hat [B,T,H,r] in q_hat's dtype.

    block_s: keys per block (TPU 512, GPU 64, CPU 128). num_splits: parallel key partitions
      (flash decoding; TPU 1, GPU ⌊132/B⌋). block_q: query rows (T·H) per program (GPU 32; else the
      rows rounded up to a power of two ≥ 16, at most 256). mode: "grid" | "loop" (see module doc).
    platform: the target backend (`_common.backend_platform`; None = the default one).
    """
    plat, interpret = target(platform, interpret)
    mode, block_s, num_splits, block_q = _defaults(mode, block_s, num_splits, block_q, q_hat.shape[0], plat,
                                                   q_hat.shape[1] * q_hat.shape[2])
    return _run(q_hat, q_pe, c, k_pe, kv_len, q_pos, float(scale), block_s, interpret, num_splits, block_q, mode,
                plat=plat)
