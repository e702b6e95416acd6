"""`paged_latent_attention_cpu`: the absorbed-MLA core as a native CPU kernel (XLA FFI custom call).

Same contract and values as `reference.paged_latent_attention` / `reference.latent_attention`
(float32), computed by `latent_cpu.cc`: the keys are read in place from the page pool (or a
contiguous cache, the case of one page per sequence) in blocks of 64 with an online softmax, a
vectorised exp and register tiles for both products; keys past a query's limit are never visited
(a causal prefill chunk costs half its square); decode-sized calls split a long cache over the
threads. Why native code: XLA:CPU runs the decode step's [H, S] x [S, r] product GEMV-shaped and the
blockwise prefill loop far below its GEMM rate, so at 64K tokens a long prompt's prefill and decode
ran at 0.42 / 0.37 of what the short-prompt rate predicts (BENCHMARKS.md "Long context through
generate, the engine and serve"), and the engine gathered every page it attends over into a copy.

Built on first use and cached (`pallas_kernels.native`); `available()` says whether it could be;
callers fall back to the XLA forms when not. CPU only, float32 only, forward only: the custom VJP
differentiates the XLA reference.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.mla.blockwise import visible_limit
from pallas_kernels.mla.reference import gather_pages, latent_attention

TARGET = "ling_latent_attention"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "latent_cpu.cc")
_KERNEL = native.NativeKernel(SOURCE, "LingLatentAttention", TARGET)


def available() -> bool:
    """True when the kernel is built, loaded and registered (once per process)."""
    return _KERNEL.available()


def load_error() -> str | None:
    return _KERNEL.load_error()


def paged_latent_attention_cpu(q_hat, q_pe, c_pages, kpe_pages, block_table, kv_len, q_pos, scale, layer=None,
                               threads: int | None = None):
    """`reference.paged_latent_attention` as the native kernel (same arguments): q_hat [B,T,H,r];
    q_pe [B,T,H,dr]; c_pages [n_pages, P, r], kpe_pages [n_pages, P, dr] (or stacked [repeats, n,
    n_pages, P, ...] with `layer` (g, j), traced or static); block_table [B, nb] int32; kv_len [B];
    q_pos [B,T]. Returns c_hat [B,T,H,r] float32. Raises RuntimeError when not `available()`."""
    if layer is None:
        flat = jnp.zeros((), jnp.int32)
    else:
        flat = jnp.asarray(layer[0], jnp.int32) * c_pages.shape[1] + jnp.asarray(layer[1], jnp.int32)
    limit = visible_limit(q_pos, kv_len)
    return _kernel(q_hat, q_pe, c_pages, kpe_pages, block_table.astype(jnp.int32), limit, flat,
                   jnp.asarray(scale, jnp.float32), int(threads or native.default_threads()))


def latent_attention_cpu(q_hat, q_pe, c, k_pe, q_pos, kv_len, scale, threads: int | None = None):
    """`reference.latent_attention` under `attention_mask(q_pos, S, kv_len)` as the native kernel:
    c [B,S,r], k_pe [B,S,dr] read as one page of S tokens per sequence (no copy)."""
    B = c.shape[0]
    table = jnp.arange(B, dtype=jnp.int32)[:, None]
    return paged_latent_attention_cpu(q_hat, q_pe, c, k_pe, table, kv_len, q_pos, scale, threads=threads)


def _reference(q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat, scale):
    """The XLA form of what the kernel computes (its VJP): the gathered pages under the limit mask."""
    lead = c_pages.shape[:-3]
    if lead:
        c_pages = c_pages.reshape((-1,) + c_pages.shape[-3:])[flat]
        kpe_pages = kpe_pages.reshape((-1,) + kpe_pages.shape[-3:])[flat]
    c, kp = gather_pages(c_pages, block_table), gather_pages(kpe_pages, block_table)
    mask = jnp.arange(c.shape[1])[None, None, :] < limit[:, :, None]  # [B,T,S]: key τ < limit[b,t]
    return latent_attention(q_hat, q_pe, c, kp, mask, scale)


def _call(q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat, scale, threads):
    if not available():
        raise RuntimeError(f"the native CPU latent attention kernel is not available: {load_error()}")
    for name, a in (("q_hat", q_hat), ("q_pe", q_pe), ("c_pages", c_pages), ("kpe_pages", kpe_pages)):
        if a.dtype != jnp.float32:
            raise TypeError(f"paged_latent_attention_cpu: {name} must be float32, got {a.dtype}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_hat.shape, jnp.float32))
    return call(q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat.reshape(()), scale.reshape(()),
                threads=np.int64(threads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _kernel(q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat, scale, threads):
    return _call(q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat, scale, threads)


def _kernel_fwd(q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat, scale, threads):
    out = _call(q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat, scale, threads)
    return out, (q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat, scale)


def _kernel_bwd(threads, res, ct):
    """The reference's VJP (the kernel computes the same values); no cotangent for the integers."""
    q_hat, q_pe, c_pages, kpe_pages, block_table, limit, flat, scale = res
    _, vjp = jax.vjp(lambda a, b, c, d, s: _reference(a, b, c, d, block_table, limit, flat, s),
                     q_hat, q_pe, c_pages, kpe_pages, scale)
    ga, gb, gc, gd, gs = vjp(ct)
    zero = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return ga, gb, gc, gd, zero(block_table), zero(limit), zero(flat), gs


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
