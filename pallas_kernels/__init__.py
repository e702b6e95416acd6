"""Pallas kernels for Ling-3.1-flash and a small dispatch between them and their XLA twins.

`impl` is "pallas", "xla", or None/"auto" (= `default_impl()`: Pallas on TPU/GPU, XLA on CPU).
A Pallas call on a CPU backend runs in interpret mode automatically (for tests; it is slow).
Every function returns exactly what its twin returns (same shapes and dtypes).
"""
from __future__ import annotations

from pallas_kernels._common import platform


def default_impl() -> str:
    """"pallas" on TPU/GPU backends, "xla" on CPU."""
    return "pallas" if platform() in ("tpu", "gpu") else "xla"


def _resolve(impl) -> str:
    impl = default_impl() if impl in (None, "auto") else impl
    if impl not in ("pallas", "xla"):
        raise ValueError(f"impl must be 'pallas', 'xla' or 'auto', got {impl!r}")
    return impl


def kda_chunk_scan(impl, q, k, v, g, beta, state, chunk_size: int = 64, **kernel_kw):
    """Chunked KDA prefill → (o [B,T,H,dv] f32, state). Twin: `ling_jax.kda.kda_chunk_scan`."""
    if _resolve(impl) == "xla":
        from ling_jax.kda import kda_chunk_scan as twin
        return twin(q, k, v, g, beta, state, chunk_size)
    from pallas_kernels.kda_chunk import kda_chunk_scan_pallas
    return kda_chunk_scan_pallas(q, k, v, g, beta, state, chunk_size, **kernel_kw)


def kda_recurrent_step(impl, state, q, k, v, g, beta, **kernel_kw):
    """One KDA decode token → (o [B,H,dv] f32, new state). Twin: `ling_jax.kda.kda_recurrent_step`."""
    if _resolve(impl) == "xla":
        from ling_jax.kda import kda_recurrent_step as twin
        return twin(state, q, k, v, g, beta)
    from pallas_kernels.kda_step import kda_recurrent_step_pallas
    return kda_recurrent_step_pallas(state, q, k, v, g, beta, **kernel_kw)


def kda_recurrent_scan(impl, q, k, v, g, beta, state, return_all_states: bool = False, **kernel_kw):
    """Token-by-token KDA over [B,T,...] inputs. Twin: `ling_jax.kda.kda_recurrent_scan`.

    Pallas: a `lax.scan` of the step kernel (T = 1 decode is a single kernel call). With
    `return_all_states` (speculative verify) the twin is used: it has to materialise every
    per-token state anyway, which is what its scan already does.
    """
    from ling_jax.kda import kda_recurrent_scan as twin
    if _resolve(impl) == "xla" or return_all_states:
        return twin(q, k, v, g, beta, state, return_all_states=return_all_states)
    import jax.numpy as jnp
    from jax import lax

    from pallas_kernels.kda_step import kda_recurrent_step_pallas

    if q.shape[1] == 1:
        o, s = kda_recurrent_step_pallas(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], **kernel_kw)
        return o[:, None], s

    def step(s, xs):
        o, s = kda_recurrent_step_pallas(s, *xs, **kernel_kw)
        return s, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    s, o = lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), s


def latent_attention(impl, q_hat, q_pe, c, k_pe, kv_len, q_pos, scale, **kernel_kw):
    """Absorbed-MLA core → c_hat [B,T,H,r] in q_hat's dtype.

    Twin: `ling_jax.mla.latent_attention(q_hat, q_pe, c, k_pe, attention_mask(q_pos, S, kv_len), scale)`.
    kv_len [B]: valid cache length (after writing the new tokens); q_pos [B,T]: absolute positions.
    """
    if _resolve(impl) == "xla":
        from ling_jax.mla import attention_mask
        from ling_jax.mla import latent_attention as twin
        return twin(q_hat, q_pe, c, k_pe, attention_mask(q_pos, c.shape[1], kv_len), scale)
    from pallas_kernels.mla_decode import latent_attention_pallas
    return latent_attention_pallas(q_hat, q_pe, c, k_pe, kv_len, q_pos, scale, **kernel_kw)


def fp8_linear(impl, x, wq, scale, block=(128, 128), **kernel_kw):
    """x @ dequant(wq, scale).T in x's dtype (wq float8_e4m3fn [N,K], scale [⌈N/128⌉,⌈K/128⌉])."""
    from pallas_kernels.fp8_matmul import fp8_linear_pallas, fp8_linear_xla
    if _resolve(impl) == "xla":
        return fp8_linear_xla(x, wq, scale, block)
    return fp8_linear_pallas(x, wq, scale, block, **kernel_kw)


__all__ = ["default_impl", "kda_chunk_scan", "kda_recurrent_step", "kda_recurrent_scan", "latent_attention",
           "fp8_linear"]
