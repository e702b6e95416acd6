"""`experts_decode_cpu`: the routed experts of N tokens as a native CPU kernel (XLA FFI custom call).

Same contract and values as `reference.experts_active_loop` (float32): each used expert's weights are
read once, in place, by `experts_decode.cc`, split over threads by expert, in register tiles of two
weight rows by four tokens (8-lane vectors, FMA). Why native code: XLA:CPU copies an expert's weights
(a dynamic slice is a copy) before every GEMM that reads them, and its capacity path computes every
expert over padded buffers. One mid-config MoE layer (64 experts 256 x 1024, top-8), against the
capacity path: 8 tokens 9.2 / 21.7 ms, 256 tokens 76.7 / 103.1, 2,048 654 / 879
(`tools/bench_moe_decode.py`; BENCHMARKS.md "Native experts kernel, fourteenth session").

The shared library is compiled on first use with the system C++ compiler (`$CXX`, else g++ / c++;
`-O3 -march=native`, against `jax.ffi.include_dir()`), cached under
`$LING_JAX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ling-jax/kernels/` (else `~/.cache/...`), keyed by the source, the flags and the
jaxlib version, written atomically (concurrent first uses are safe). `available()` tells whether it
could be built and loaded; the model falls back to the XLA loop when not. CPU only, float32 only,
forward only (the custom VJP differentiates the XLA reference).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.experts.reference import experts_active_loop

TARGET = "ling_experts_decode"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "experts_decode.cc")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC", "-w")
_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> str:
    if os.environ.get("LING_JAX_KERNEL_CACHE"):
        return os.environ["LING_JAX_KERNEL_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ling-jax", "kernels")


def _compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "c++"):
        if c and shutil.which(c):
            return c
    return None


def _build(source: str = SOURCE) -> str:
    """Path of the compiled library (built now if not cached). Raises RuntimeError on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    src = open(source, "rb").read()
    key = hashlib.sha256(src + " ".join((cxx,) + FLAGS).encode() + jax.__version__.encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib = os.path.join(out_dir, f"experts_decode-{key}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", "-o", tmp, source, "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling {source} failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: a concurrent builder's identical file is replaced, never half-read
    return lib


def available() -> bool:
    """True when the kernel is built, loaded and registered (once per process; the error is kept
    in `load_error()` otherwise)."""
    with _lock:
        if "ok" not in _state:
            try:
                lib = ctypes.cdll.LoadLibrary(_build())
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.LingExpertsDecode), platform="cpu")
                _state.update(ok=True, lib=lib)
            except Exception as e:  # no compiler, a failed build, an old jaxlib without FFI
                _state.update(ok=False, error=f"{type(e).__name__}: {e}")
        return _state["ok"]


def register_variant(source: str, target: str):
    """Build another version of the kernel's source (same FFI signature) and register it as `target`;
    returns `fn(x, idx, wts, wg, wu, wd, limit, threads=None)` calling it (no VJP). For side-by-side
    benchmarks of a kernel change in one process (`tools/bench_moe_decode.py --native-variant`)."""
    lib = ctypes.cdll.LoadLibrary(_build(source))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.LingExpertsDecode), platform="cpu")
    _state.setdefault("variants", []).append(lib)  # keep it loaded

    return lambda x, idx, wts, wg, wu, wd, limit, threads=None: _ffi(target, x, idx, wts, wg, wu, wd, limit,
                                                                     int(threads or default_threads()))


def load_error() -> str | None:
    return _state.get("error")


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def experts_decode_cpu(x, idx, wts, wg, wu, wd, limit, threads: int | None = None):
    """`reference.experts_active_loop` as the native kernel: x [N,D] f32; idx [N,k] int (ids outside
    [0, E) add nothing); wts [N,k] f32; wg, wu [E,I,D], wd [E,D,I] f32; limit: the SwiGLU clamp
    (0 = off). Returns [N,D] float32. Differentiable (through the reference). Raises RuntimeError
    when the kernel is not `available()`."""
    return _kernel(x, idx, wts, wg, wu, wd, limit, int(threads or default_threads()))


def _call(x, idx, wts, wg, wu, wd, limit, threads):
    if not available():
        raise RuntimeError(f"the native CPU experts kernel is not available: {load_error()}")
    for name, a in (("x", x), ("wg", wg), ("wu", wu), ("wd", wd)):
        if a.dtype != jnp.float32:
            raise TypeError(f"experts_decode_cpu: {name} must be float32, got {a.dtype}")
    return _ffi(TARGET, x, idx, wts, wg, wu, wd, limit, threads)


def _ffi(target, x, idx, wts, wg, wu, wd, limit, threads: int):
    """The custom call registered as `target` (the kernel, or a benchmark's variant of it)."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    return call(x, idx.astype(jnp.int32), wts.astype(jnp.float32), wg, wu, wd,
                jnp.asarray(limit, jnp.float32).reshape(()), threads=np.int64(threads))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _kernel(x, idx, wts, wg, wu, wd, limit, threads):
    return _call(x, idx, wts, wg, wu, wd, limit, threads)


def _kernel_fwd(x, idx, wts, wg, wu, wd, limit, threads):
    return _call(x, idx, wts, wg, wu, wd, limit, threads), (x, idx, wts, wg, wu, wd, limit)


def _kernel_bwd(threads, res, ct):
    """The reference's VJP (the kernel computes the same values)."""
    x, idx, wts, wg, wu, wd, limit = res
    _, vjp = jax.vjp(lambda x, w, g, u, d, l: experts_active_loop(x, idx, w, g, u, d, l), x, wts, wg, wu, wd, limit)
    gx, gw, gg, gu, gd, gl = vjp(ct)
    return gx, None, gw, gg, gu, gd, gl


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
