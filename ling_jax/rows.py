"""Gathers and scatters of a few rows of a large donated buffer, kept in place by XLA.

The engine's programs read a few slot rows of each pool (`take_rows`) and write them back
(`put_rows`), with the pools donated so the write is in place. One case defeats that on XLA:CPU:
a single index. XLA turns a one-index gather into a dynamic slice fused into every consumer (so
the buffer is read by many fusions the write does not depend on); to keep the original readable it
then copies the whole buffer (measured: a 1-row decode step on a 32-slot mid-config engine copied
every KDA pool, 161 ms per token against 35 ms on a 1-slot engine). With two or more indices the
gather stays a real gather and nothing is copied. So a one-row read is padded with one index past
the end (clipped on read and sliced off; dropped on write: the same values, no copy). On TPU the writes,
and the reads along a tiled axis, go one row at a time (`put_rows`, `take_rows`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _at_least_two(idx: jax.Array, size: int) -> jax.Array:
    """idx [R] int, or [idx[0], size] when R == 1 (size = one past the end)."""
    if idx.shape[0] != 1:
        return idx
    return jnp.concatenate([idx, jnp.full((1,), size, idx.dtype)])


def take_rows(x: jax.Array, idx: jax.Array, axis: int = 0) -> jax.Array:
    """x's rows idx [R] along `axis` (indices past the end read the last row: "clip").

    XLA:CPU and GPU get one gather (a one-row index padded to two: module doc). So does TPU along an
    untiled (major) axis; along one of the two tiled minor axes, one `dynamic_slice` per row
    (`jax.lax.platform_dependent`, as `put_rows`): for such a gather (the slots of a KDA conv-tap pool
    [.., S, H·dk] are its second-minor dimension) the TPU compiler relaid out the whole pool first, in
    and out, in every program that gathers slot rows (tests/test_aot.py); a row slice reads the pool
    as it lies. (Along a major axis the slices' concatenation would only add a copy of the rows.)"""
    gathered = functools.partial(_take_rows_gathered, axis=axis)
    if axis % x.ndim < x.ndim - 2:
        return gathered(x, idx)
    return jax.lax.platform_dependent(x, idx, tpu=functools.partial(_take_rows_sliced, axis=axis), default=gathered)


def _take_rows_gathered(x, idx, axis):
    got = jnp.take(x, _at_least_two(idx, x.shape[axis]), axis=axis, mode="clip")
    return jax.lax.slice_in_dim(got, 0, idx.shape[0], axis=axis) if idx.shape[0] == 1 else got


def _take_rows_sliced(x, idx, axis):
    # dynamic_slice clamps its start into the array: an index past the end reads the last row ("clip")
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, idx[r], 1, axis=axis) for r in range(idx.shape[0])],
                           axis=axis)


def put_rows(x: jax.Array, idx: jax.Array, values: jax.Array, axis: int = 0) -> jax.Array:
    """x with its rows idx [R] along `axis` set to values (R rows along `axis`, cast to x's dtype);
    indices past the end are dropped (padding rows).

    The form depends on the compiler (`jax.lax.platform_dependent`, chosen where the program is
    lowered, so a compile-only TPU target gets the TPU form): XLA:CPU and GPU get one scatter (a
    one-row index padded to two, as `take_rows`); TPU a `dynamic_update_slice` per row in a loop
    over R (`_put_rows_looped`). The TPU compiler stages a slot scatter of a whole stacked pool in
    scoped VMEM and refuses it for the KDA conv states (3 rows of a window padded to 8 sublanes:
    "CompileTimeScopedVmemOom" on bf16[8,7,8,3,8192], the real config's tpu7x prefill; at 64 slots it
    did not finish compiling), while the row loop compiles in place at any slot count. Elsewhere the
    scatter stays: on XLA:CPU the loop is in place too but 1.5-2x slower, and on a GPU it would be R
    kernel launches per pool."""
    values = values.astype(x.dtype)
    return jax.lax.platform_dependent(x, idx, values, tpu=functools.partial(_put_rows_looped, axis=axis),
                                      default=functools.partial(_put_rows_scattered, axis=axis))


def _put_rows_scattered(x, idx, values, axis):
    if idx.shape[0] == 1:
        values = jnp.concatenate([values, jnp.zeros_like(values)], axis=axis)
    return x.at[(slice(None),) * axis + (_at_least_two(idx, x.shape[axis]),)].set(values, mode="drop")


def _put_rows_looped(x, idx, values, axis):
    size = x.shape[axis]

    def one(r, out):
        i = idx[r]
        at = jnp.minimum(i, size - 1)  # indices are >= 0 (past the end: dropped), so none is mapped from the end
        old = jax.lax.dynamic_slice_in_dim(out, at, 1, axis=axis, allow_negative_indices=False)
        new = jax.lax.dynamic_slice_in_dim(values, r, 1, axis=axis, allow_negative_indices=False)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(i < size, new, old), at, axis=axis,
                                                   allow_negative_indices=False)

    return jax.lax.fori_loop(0, idx.shape[0], one, x)


def take_last(x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """x[b, max(n_valid[b] - 1, 0)] for x [B, T, ...]: each row's last valid position (a right-padded
    call's last fed token)."""
    idx = jnp.maximum(n_valid - 1, 0)
    return jnp.take_along_axis(x, idx.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]
