"""Gathers and scatters of a few rows of a large donated buffer, kept in place by XLA.

The engine's programs read a few slot rows of each pool (`take_rows`) and write them back
(`put_rows`), with the pools donated so the write is in place. One case defeats that on XLA:CPU:
a single index. XLA turns a one-index gather into a dynamic slice fused into every consumer (so
the buffer is read by many fusions the write does not depend on) and a one-index "drop" scatter
into `select(in_bounds, dynamic_update_slice(x), x)`; to keep the original readable it then copies
the whole buffer, twice (measured: a 1-row decode step on a 32-slot mid-config engine copied every
KDA pool, 161 ms per token against 35 ms on a 1-slot engine). With two or more indices both stay
real gather / scatter ops and nothing is copied. So a one-row index is padded with one index past
the end (clipped on read and sliced off; dropped on write): the same values, no copy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _at_least_two(idx: jax.Array, size: int) -> jax.Array:
    """idx [R] int, or [idx[0], size] when R == 1 (size = one past the end)."""
    if idx.shape[0] != 1:
        return idx
    return jnp.concatenate([idx, jnp.full((1,), size, idx.dtype)])


def take_rows(x: jax.Array, idx: jax.Array, axis: int = 0) -> jax.Array:
    """x's rows idx [R] along `axis` (indices past the end read the last row: "clip")."""
    got = jnp.take(x, _at_least_two(idx, x.shape[axis]), axis=axis, mode="clip")
    return jax.lax.slice_in_dim(got, 0, idx.shape[0], axis=axis) if idx.shape[0] == 1 else got


def put_rows(x: jax.Array, idx: jax.Array, values: jax.Array, axis: int = 0) -> jax.Array:
    """x with its rows idx [R] along `axis` set to values (R rows along `axis`, cast to x's dtype);
    indices past the end are dropped (padding rows)."""
    values = values.astype(x.dtype)
    if idx.shape[0] == 1:
        values = jnp.concatenate([values, jnp.zeros_like(values)], axis=axis)
    return x.at[(slice(None),) * axis + (_at_least_two(idx, x.shape[axis]),)].set(values, mode="drop")
