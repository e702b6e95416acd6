"""FP8 (E4M3, 128×128 block scales) weight × activation matmul (spec §13).

`fp8_linear_pallas(x, wq, scale)` = x @ dequant(wq, scale).T without materialising the dequantised
weight in HBM: the kernel streams float8 tiles (1 byte per weight instead of 2 for bf16) and applies
the block scales to the partial products in float32,

    out[:, n] = Σ_kb  scale[n // 128, kb] · (x[:, kb-block] @ wq[n, kb-block]ᵀ)

one 128-wide K slice at a time. float8 → bf16 is exact (E4M3 ⊂ bf16), so with bf16 activations
the MXU/tensor cores see exactly the stored weights; the scale multiply happens after the dot.

Tiles: grid (M/bm, N/bn, K/bk) with the K axis innermost ("arbitrary"); bn and bk are multiples
of the quantisation block. The scale grid is passed expanded along N as [K/128, N] (3 % of the
fp8 weight bytes for 128-blocks) so each K slice reads one [1, bn] row of scales: any bn works
and no scalar has to be moved from vector to scalar registers. M, N, K that are not multiples of
the tiles are zero-padded outside the kernel (zero weights and activations contribute nothing).

Reference: `fp8.reference.fp8_linear` = `linear(x, block_dequant_fp8_jax(wq, scale))`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import compiler_params, dot, next_pow2, round_up, target

F32 = jnp.float32


def _kernel(x_ref, w_ref, s_ref, o_ref, *scratch, qbk: int, n_sub: int, n_k: int, unroll: bool):
    k = pl.program_id(2)
    cdt = x_ref.dtype  # bf16 activations → bf16 MXU operands (exact fp8 → bf16); f32 → f32 HIGHEST

    def step(j, acc):
        start = j * qbk  # a Python int when unrolled: Triton cannot annotate a constant with multiple_of
        cols = pl.ds(start if isinstance(start, int) else pl.multiple_of(start, qbk), qbk)
        part = dot(x_ref[:, cols], w_ref[:, cols].astype(cdt), trans_b=True)  # [bm,bn] f32
        return acc + part * s_ref[pl.ds(k * n_sub + j, 1), :]

    acc = jnp.zeros(o_ref.shape, F32)
    if unroll:
        for j in range(n_sub):
            acc = step(j, acc)
    else:
        acc = jax.lax.fori_loop(0, n_sub, step, acc)

    if n_k == 1:
        o_ref[...] = acc.astype(o_ref.dtype)
        return
    (acc_ref,) = scratch

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    acc_ref[...] += acc

    @pl.when(k == n_k - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _defaults(M, N, K, block, block_m, block_n, block_k, plat: str):
    qbn, qbk = block
    if block_m is None:
        block_m = min(256 if plat == "tpu" else 64, next_pow2(max(M, 16)))
    n_pad, k_pad = round_up(N, qbn), round_up(K, qbk)
    if block_n is None:  # largest tile that divides the 128-padded width (no padding beyond 128)
        block_n = 2 * qbn if plat == "tpu" and n_pad % (2 * qbn) == 0 else qbn
    if block_k is None:  # Triton: the whole K per program (its grid programs run concurrently)
        block_k = next(b for b in (4 * qbk, 2 * qbk, qbk) if k_pad % b == 0) if plat == "tpu" else k_pad
    return block_m, block_n, block_k


@functools.partial(jax.jit, static_argnames=("plat", "block", "interpret", "block_m", "block_n", "block_k"))
def _run(x, wq, scale, block, interpret, block_m, block_n, block_k, plat):
    M, K = x.shape
    N = wq.shape[0]
    qbn, qbk = block
    bm, bn, bk = block_m, block_n, block_k
    if bn % qbn or bk % qbk:
        raise ValueError(f"block_n {bn} / block_k {bk} must be multiples of the quantisation block {block}")
    Mp, Np, Kp = round_up(M, bm), round_up(N, bn), round_up(K, bk)
    if (Mp, Kp) != (M, K):
        x = jnp.pad(x, ((0, Mp - M), (0, Kp - K)))
    if (Np, Kp) != (N, K):
        wq = jnp.pad(wq, ((0, Np - N), (0, Kp - K)))
    # scale [ceil(N/qbn), ceil(K/qbk)] → expanded along N and transposed: [Kp/qbk, Np]
    s = jnp.repeat(scale.astype(F32).T, qbn, axis=1)[:, :N]
    s = jnp.pad(s, ((0, Kp // qbk - s.shape[0]), (0, Np - N)))
    n_sub, n_k = bk // qbk, Kp // bk
    kernel = functools.partial(_kernel, qbk=qbk, n_sub=n_sub, n_k=n_k, unroll=n_sub <= 8)
    scratch = [pltpu.VMEM((bm, bn), F32)] if n_k > 1 else []
    out = pl.pallas_call(
        kernel,
        grid=(Mp // bm, Np // bn, n_k),
        in_specs=[pl.BlockSpec((bm, bk), lambda m, n, k: (m, k)),
                  pl.BlockSpec((bn, bk), lambda m, n, k: (n, k)),
                  pl.BlockSpec((Kp // qbk, bn), lambda m, n, k: (0, n))],
        out_specs=pl.BlockSpec((bm, bn), lambda m, n, k: (m, n)),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), x.dtype),
        scratch_shapes=scratch,
        compiler_params=compiler_params(interpret, plat, ("parallel", "parallel", "arbitrary"), num_warps=4,
                                        num_stages=3),
        interpret=interpret,
        name="fp8_linear",
    )(x, wq, s)
    return out[:M, :N]


def fp8_linear_pallas(x, wq, scale, block=(128, 128), interpret=None, *, block_m: int | None = None,
                      block_n: int | None = None, block_k: int | None = None, platform: str | None = None):
    """x [M,K] (bf16/f32) @ dequant(wq [N,K] float8_e4m3fn, scale [⌈N/128⌉,⌈K/128⌉] f32).T → [M,N] in x's dtype.

    block: the quantisation block (rows, cols) of the scale grid. block_m/n/k: kernel tiles
    (n, k multiples of block; defaults TPU 256/256/512, GPU 64/128/whole K, M rounded to ≥ 16).
    Leading batch dims of x are flattened.
    platform: the target backend (`_common.backend_platform`; None = the default one).
    """
    plat, interpret = target(platform, interpret)
    block = (int(block[0]), int(block[1]))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    bm, bn, bk = _defaults(x2.shape[0], wq.shape[0], wq.shape[1], block, block_m, block_n, block_k, plat)
    out = _run(x2, wq, scale, block, interpret, bm, bn, bk, plat=plat)
    return out.reshape(lead + (wq.shape[0],))
