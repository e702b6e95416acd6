"""`experts_decode_cpu`: the routed experts of N tokens as a native CPU kernel (XLA FFI custom call).

Same contract and values as `reference.experts_active_loop` (float32): each used expert's weights are
read once, in place, by `experts_decode.cc`, split over threads by expert, in register tiles of two
weight rows by four tokens (8-lane vectors, FMA); an expert picked by 12 tokens or more runs the same
sums, in the same order, as a GEMM with the tokens across the vector lanes (bit-identical: a token's
result does not depend on how many tokens share its expert). Why native code: XLA:CPU copies an expert's weights
(a dynamic slice is a copy) before every GEMM that reads them, and its capacity path computes every
expert over padded buffers. One mid-config MoE layer (64 experts 256 x 1024, top-8), against the
capacity path: 8 tokens 9.2 / 21.7 ms, 256 tokens 76.7 / 103.1, 2,048 654 / 879
(`tools/bench_moe_decode.py`; BENCHMARKS.md "Native experts kernel, fourteenth session").

Weights stored in the GEMM's panel order (`panels.pack_panels`, `packed=True`) are read in place without
a pack per call: the GEMM form at every token count, the same bits (BENCHMARKS.md "Thirty-fifth session");
ling-jax stores a model's experts so when it loads one onto a CPU (`ling_jax.expert_panels`).

The shared library is compiled on first use and cached (`pallas_kernels.native`). `available()` tells whether it
could be built and loaded; the model falls back to the XLA loop when not. CPU only, float32 only,
forward only (the custom VJP differentiates the XLA reference).
"""
from __future__ import annotations

import os
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.experts.panels import check_packable, unpack_panels
from pallas_kernels.experts.reference import experts_active_loop
from pallas_kernels.native import default_threads

TARGET = "ling_experts_decode"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "experts_decode.cc")
_KERNEL = native.NativeKernel(SOURCE, "LingExpertsDecode", TARGET)
_variants: list = []
__all__ = ["available", "load_error", "default_threads", "experts_decode_cpu", "register_variant"]


def available() -> bool:
    """True when the kernel is built, loaded and registered (once per process; the error is kept
    in `load_error()` otherwise)."""
    return _KERNEL.available()


def load_error() -> str | None:
    return _KERNEL.load_error()


def register_variant(source: str, target: str):
    """Build another version of the kernel's source (same FFI signature) and register it as `target`;
    returns `fn(x, idx, wts, wg, wu, wd, limit, threads=None)` calling it (no VJP). For side-by-side
    benchmarks of a kernel change in one process (`tools/bench_moe_decode.py --native-variant`)."""
    _variants.append(native.register(source, "LingExpertsDecode", target))  # keep it loaded

    return lambda x, idx, wts, wg, wu, wd, limit, threads=None: _ffi(target, x, idx, wts, wg, wu, wd, limit,
                                                                     int(threads or default_threads()), None)


def experts_decode_cpu(x, idx, wts, wg, wu, wd, limit, threads: int | None = None, packed: bool = False):
    """`reference.experts_active_loop` as the native kernel: x [N,D] f32; idx [N,k] int (ids outside
    [0, E) add nothing); wts [N,k] f32; wg, wu [E,I,D], wd [E,D,I] f32; limit: the SwiGLU clamp
    (0 = off). packed: the three weights are stored in the kernel's panel order (`panels.pack_panels`;
    D and I multiples of 16), read in place without a pack per call; the same bits. Returns [N,D]
    float32. Differentiable (through the reference; with `packed`, the weights' gradients in panel
    order too). Raises RuntimeError when the kernel is not `available()`."""
    if packed:
        for name, w in (("wg", wg), ("wu", wu), ("wd", wd)):
            check_packable(w.shape, f"experts_decode_cpu: {name}")
    return _kernel(x, idx, wts, wg, wu, wd, limit, int(threads or default_threads()), bool(packed))


def _call(x, idx, wts, wg, wu, wd, limit, threads, packed):
    if not available():
        raise RuntimeError(f"the native CPU experts kernel is not available: {load_error()}")
    for name, a in (("x", x), ("wg", wg), ("wu", wu), ("wd", wd)):
        if a.dtype != jnp.float32:
            raise TypeError(f"experts_decode_cpu: {name} must be float32, got {a.dtype}")
    return _ffi(TARGET, x, idx, wts, wg, wu, wd, limit, threads, packed)


def _ffi(target, x, idx, wts, wg, wu, wd, limit, threads: int, packed: bool | None):
    """The custom call registered as `target` (the kernel, or a benchmark's variant of it: packed None,
    the attribute not sent, since a variant built from an older source does not declare it)."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    attrs = {"threads": np.int64(threads)}
    if packed is not None:
        attrs["packed"] = np.int64(int(packed))
    return call(x, idx.astype(jnp.int32), wts.astype(jnp.float32), wg, wu, wd,
                jnp.asarray(limit, jnp.float32).reshape(()), **attrs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel(x, idx, wts, wg, wu, wd, limit, threads, packed):
    return _call(x, idx, wts, wg, wu, wd, limit, threads, packed)


def _kernel_fwd(x, idx, wts, wg, wu, wd, limit, threads, packed):
    return _call(x, idx, wts, wg, wu, wd, limit, threads, packed), (x, idx, wts, wg, wu, wd, limit)


def _kernel_bwd(threads, packed, res, ct):
    """The reference's VJP (the kernel computes the same values); packed weights are read through
    `unpack_panels`, a permutation, so their gradients come back in panel order."""
    x, idx, wts, wg, wu, wd, limit = res
    rows = unpack_panels if packed else (lambda w: w)
    _, vjp = jax.vjp(lambda x, w, g, u, d, l: experts_active_loop(x, idx, w, rows(g), rows(u), rows(d), l),
                     x, wts, wg, wu, wd, limit)
    gx, gw, gg, gu, gd, gl = vjp(ct)
    return gx, None, gw, gg, gu, gd, gl


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
