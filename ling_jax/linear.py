"""Bias-free linear layer holding its weight in the checkpoint's `[out, in]` layout.

The weight is a float array or, when a checkpoint's FP8 matrix is kept quantised, a `BlockFP8`
(float8_e4m3fn values + float32 block scales, `ling_jax.quantized`): one class, dispatching on what
the weight is. A BlockFP8 weight is dequantised inside the matmul: `ex.kernels == "pallas"` runs
the Pallas FP8 kernel (interpret mode on CPU), "xla" its pure-XLA reference. `matrix(dtype)` gives
the (dequantised) weight itself for code that needs it (MLA's absorbed `kv_b_proj`). Inside a scanned
layer loop on XLA:CPU the weight may be a `TableRows` (its rows of the run's stack, read in place by
the native kernel).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.exec_config import ExecConfig
from ling_jax.kernel_mesh import fp8_linear_on_mesh
from ling_jax.ops import linear
from ling_jax.placement import param_mesh
from ling_jax.quantized import BlockFP8, dequantize
from pallas_kernels.fp8.kernel import fp8_linear_pallas
from pallas_kernels.fp8.reference import fp8_linear
from pallas_kernels.linear import cpu_kernel as table_kernel
from pallas_kernels.linear.reference import table_rows


@jax.tree_util.register_pytree_node_class
class TableRows:
    """A layer's weight [rows, in] as rows [base, base + rows) of its scanned run's stacked weights
    merged into one table [repeats · n · rows, in] (a reshape of the stack, no copy): what
    `layer_stack` hands a layer of a scanned run on XLA:CPU (`ExecConfig.native_linear`) so that the
    native kernel reads the rows where they are stored, whatever the number of input rows (decode,
    verify, prefill); `matrix()`, for code that needs the matrix itself, slices them out."""

    def __init__(self, table: jax.Array, base: jax.Array, rows: int):
        self.table, self.base, self.rows = table, base, int(rows)

    def tree_flatten(self):
        return (self.table, self.base), self.rows

    @classmethod
    def tree_unflatten(cls, rows, children):
        return cls(*children, rows)

    @property
    def shape(self) -> tuple:
        return (self.rows, self.table.shape[1])

    @property
    def dtype(self):
        return self.table.dtype

    def matrix(self) -> jax.Array:
        return table_rows(self.table, self.base, self.rows)

    def apply(self, x: jax.Array) -> jax.Array:
        """x [..., in] @ Wᵀ -> [..., rows] float32, by the native kernel over the rows where they are
        stored (`table_linear_cpu`; x float32, see `reads_in_place`)."""
        return table_kernel.table_linear_cpu(x, self.table, self.base, self.rows)


def reads_in_place(w, dtype) -> bool:
    """Whether a product of an input of `dtype` with weight w runs the native kernel over w's rows in
    place: w a `TableRows`, the input float32, the kernel built. Any number of rows: from 12 the kernel's packed-panel
    GEMM runs level with XLA:CPU's slice + dot up to 128 rows and 6-15% behind at 512 on a Zen 3 host
    (tools/bench_small_matmul.py --table, BENCHMARKS.md "Thirty-second session"), without the copy."""
    return isinstance(w, TableRows) and dtype == jnp.float32 and table_kernel.available()


def init_normal(rngs: nnx.Rngs, shape, dtype, fan_in: int | None = None):
    """N(0, 1/fan_in): keeps activations O(1) in randomly initialised models."""
    fan_in = fan_in or shape[-1]
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)


class Linear(nnx.Module):
    """`weight` [out, in]: a float array, or a `BlockFP8` when the checkpoint's FP8 matrix is kept
    quantised. `axes` = (logical name of `out`, of `in`) (vocabulary: sharding/rules.py), declared
    here so the sharding rules place the weight without knowing its path."""

    def __init__(self, in_features: int, out_features: int, *, axes: tuple, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (out_features, in_features), dtype), axes=tuple(axes))

    def __call__(self, x: jax.Array, ex: ExecConfig | None = None) -> jax.Array:
        """`x @ weight.T` in x's dtype; a BlockFP8 weight is dequantised inside the matmul by the
        kernel `ex.kernels` selects (the dequantised weight is never stored)."""
        w = self.weight.get_value()
        if reads_in_place(w, x.dtype):
            return w.apply(x)
        if isinstance(w, TableRows):
            return linear(x, w.matrix(), ex.weights_first_rows if ex is not None else 0)  # sliced, then cast
        if isinstance(w, BlockFP8):
            if ex is not None and ex.kernels == "pallas":
                kernel = partial(fp8_linear_pallas, platform=ex.platform)
                return fp8_linear_on_mesh(kernel, fp8_linear, param_mesh(self.weight), x, w.values, w.scales, w.block,
                                          self.weight.get_metadata()["axes"])
            return fp8_linear(x, w.values, w.scales, w.block)
        return linear(x, w, ex.weights_first_rows if ex is not None else 0)

    def matrix(self, dtype=None) -> jax.Array:
        """The weight (a BlockFP8 one dequantised: float32 product, then `dtype`, exactly what a
        dequantising load holds)."""
        w = self.weight.get_value()
        if isinstance(w, TableRows):
            w = w.matrix()
        if isinstance(w, BlockFP8):
            return dequantize(w, dtype or jnp.float32)
        return w if dtype is None else w.astype(dtype)
