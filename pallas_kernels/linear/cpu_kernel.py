"""`table_linear_cpu`: one layer's float32 linear layer read in place from its scanned run's table, as
a native CPU kernel (XLA FFI custom call, `table_linear.cc`).

Same contract as `reference.table_linear` (x [..., K] @ table[base:base + rows].T, base clamped to
[0, R - rows]). Why native code: inside a scan XLA:CPU copies a dynamic slice of a
weight stack before the dot that reads it (a decode step wrote every dense weight once more and read it
twice); the kernel reads the rows where they are stored. Few rows run as dot tiles (two weight rows by
four activation rows), 12 or more as the packed-panel GEMM shared with the experts kernel
(`native_tiles.h`: level with XLA:CPU's slice + dot up to 128 rows); a row's result never depends on
the rows beside it. A weight of 256K elements or more is split over the
calling thread and persistent workers (started once per process: a thread started per call cost a
decode-sized call up to a third of its time). CPU only, float32 only; the VJP differentiates the
reference. `available()` tells whether the library could be built; callers fall back to the reference.

`table_heads_cpu`: the per-head form (`reference.table_heads`, MLA's kv_b_proj as W_UK / W_UV), the same
library: rows as outputs as above, rows contracted (x @ W_h) by 6 x 16 register tiles, one FMA chain
per output in row order; heads split over the threads.
"""
from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native
from pallas_kernels.linear.reference import table_heads, table_linear
from pallas_kernels.native import default_threads

TARGET = "ling_table_linear"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "table_linear.cc")
HEADS_TARGET = "ling_table_heads"
_KERNEL = native.NativeKernel(SOURCE, "LingTableLinear", TARGET)
_HEADS = native.NativeKernel(SOURCE, "LingTableHeads", HEADS_TARGET)
__all__ = ["available", "load_error", "table_heads_cpu", "table_linear_cpu"]


def available() -> bool:
    """True when the kernels are built, loaded and registered (once per process)."""
    return _KERNEL.available() and _HEADS.available()


def load_error() -> str | None:
    return _KERNEL.load_error() or _HEADS.load_error()


def table_linear_cpu(x, table, base, rows: int, threads: int | None = None):
    """`reference.table_linear(x, table, base, rows)` by the native kernel: x [..., K] float32, table
    [R, K] float32, base an int32 scalar (traced), rows static → [..., rows] float32. Differentiable
    (through the reference). Raises RuntimeError when the kernel is not `available()`."""
    if not available():
        raise RuntimeError(f"the native CPU table-linear kernel is not available: {load_error()}")
    for name, a in (("x", x), ("table", table)):
        if a.dtype != jnp.float32:
            raise TypeError(f"table_linear_cpu: {name} must be float32, got {a.dtype}")
    if table.ndim != 2 or x.shape[-1] != table.shape[1] or not 0 < rows <= table.shape[0]:
        raise ValueError(f"table_linear_cpu: x {x.shape}, table {table.shape}, rows {rows}: expected x [..., K], "
                         f"table [R, K], 0 < rows <= R")
    return _kernel(x, table, jnp.asarray(base, jnp.int32), int(rows), int(threads or default_threads()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel(x, table, base, rows, threads):
    lead = x.shape[:-1]
    xm = x.reshape(math.prod(lead), x.shape[-1])
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((xm.shape[0], rows), jnp.float32))
    return call(xm, table, base.reshape(()), threads=np.int64(threads)).reshape(*lead, rows)


def _fwd(x, table, base, rows, threads):
    return _kernel(x, table, base, rows, threads), (x, table, base)


def _bwd(rows, threads, res, g):
    x, table, base = res
    _, vjp = jax.vjp(lambda x, t: table_linear(x, t, base, rows), x, table)
    return (*vjp(g), np.zeros((), jax.dtypes.float0))


_kernel.defvjp(_fwd, _bwd)


def table_heads_cpu(x, table, base, heads: int, stride: int, offset: int, rows: int, contract: bool,
                    threads: int | None = None):
    """`reference.table_heads(...)` by the native kernel: x [..., heads, K] (contract False) or
    [..., heads, rows] (contract True) float32, table [R, K] float32, base an int32 scalar (traced).
    Differentiable (through the reference). Raises RuntimeError when the kernel is not `available()`."""
    if not available():
        raise RuntimeError(f"the native CPU table-linear kernel is not available: {load_error()}")
    for name, a in (("x", x), ("table", table)):
        if a.dtype != jnp.float32:
            raise TypeError(f"table_heads_cpu: {name} must be float32, got {a.dtype}")
    want = rows if contract else table.shape[-1]
    if (table.ndim != 2 or x.ndim < 2 or x.shape[-2:] != (heads, want) or not 0 < rows
            or not 0 <= offset <= stride - rows or heads * stride > table.shape[0]):
        raise ValueError(f"table_heads_cpu: x {x.shape}, table {table.shape}, heads {heads}, stride {stride}, "
                         f"offset {offset}, rows {rows}: expected x [..., heads, {want}], table [R, K] with "
                         f"heads * stride <= R and 0 <= offset <= stride - rows")
    return _heads(x, table, jnp.asarray(base, jnp.int32), int(heads), int(stride), int(offset), int(rows),
                  bool(contract), int(threads or default_threads()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _heads(x, table, base, heads, stride, offset, rows, contract, threads):
    lead, K = x.shape[:-2], table.shape[1]
    xm = x.reshape(math.prod(lead), -1)
    out_w = K if contract else rows
    call = jax.ffi.ffi_call(HEADS_TARGET, jax.ShapeDtypeStruct((xm.shape[0], heads * out_w), jnp.float32))
    out = call(xm, table, base.reshape(()), threads=np.int64(threads), heads=np.int64(heads),
               stride=np.int64(stride), offset=np.int64(offset), rows=np.int64(rows), contract=np.int64(contract))
    return out.reshape(*lead, heads, out_w)


def _heads_fwd(x, table, base, heads, stride, offset, rows, contract, threads):
    return _heads(x, table, base, heads, stride, offset, rows, contract, threads), (x, table, base)


def _heads_bwd(heads, stride, offset, rows, contract, threads, res, g):
    x, table, base = res
    _, vjp = jax.vjp(lambda x, t: table_heads(x, t, base, heads, stride, offset, rows, contract), x, table)
    return (*vjp(g), np.zeros((), jax.dtypes.float0))


_heads.defvjp(_heads_fwd, _heads_bwd)
