"""`table_linear`: one layer's linear layer whose weight is a block of rows of a larger table (the
pure-XLA twin of `cpu_kernel.table_linear_cpu`).

Why a table: a scanned layer loop stores each run's weights stacked `[repeats, n, out, in]`; merged to
`[repeats · n · out, in]` (a reshape, no copy) layer (g, j)'s weight is rows `[(g·n + j)·out, +out)`.
`table_heads` is the per-head form MLA's absorbed attention needs (kv_b_proj's W_UK and W_UV, each a
block of rows per head). Imports nothing from the model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import linear


def table_rows(table: jax.Array, base, rows: int) -> jax.Array:
    """Rows [base, base + rows) of table [R, K], base clamped to [0, R - rows] (`lax.dynamic_slice`
    without its wrap-around of negative starts) → [rows, K]."""
    return jax.lax.dynamic_slice(table, (base, 0), (rows, table.shape[1]), allow_negative_indices=False)


def table_linear(x: jax.Array, table: jax.Array, base, rows: int, weights_first_rows: int = 0) -> jax.Array:
    """`x @ table[base:base + rows].T`: x [..., K], table [R, K] → [..., rows] in x's dtype (the
    precision policy of `pallas_kernels.matmul.linear`)."""
    return linear(x, table_rows(table, base, rows), weights_first_rows)


def table_heads(x: jax.Array, table: jax.Array, base, heads: int, stride: int, offset: int, rows: int,
                contract: bool) -> jax.Array:
    """Per head h < heads, W_h = rows [base + h·stride + offset, + rows) of table [R, K] (the block of
    heads·stride rows at base clamped to [0, R - heads·stride]). contract False: x [..., H, K] →
    [..., H, rows], x_h @ W_hᵀ; contract True: x [..., H, rows] → [..., H, K], x_h @ W_h. float32 at
    HIGHEST precision."""
    K = table.shape[1]
    w = table_rows(table, base, heads * stride).reshape(heads, stride, K)[:, offset:offset + rows]
    spec = "...hd,hdk->...hk" if contract else "...hk,hdk->...hd"
    return jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)
