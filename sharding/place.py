"""Placing caches and inputs on a mesh, and bringing results back to the host.

Parameters are placed where they are loaded (`ling_jax.loader`), by their declared logical axes.
"""
from __future__ import annotations


import jax
from jax.experimental import multihost_utils
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding.mesh import mesh_sizes
from sharding.rules import cache_shardings


def shard_cache(cache, mesh):
    """`jax.device_put` a HybridCache onto `mesh` by the cache rules."""
    return jax.device_put(cache, cache_shardings(cache, mesh))


def batch_sharding(mesh, ndim: int, batch: int | None = None) -> NamedSharding:
    """Batch (axis 0) over `data` when it divides evenly, everything else replicated."""
    n = mesh_sizes(mesh).get("data", 1)
    first = "data" if batch is None or (n > 1 and batch % n == 0) else None
    return NamedSharding(mesh, P(first, *([None] * (ndim - 1))))


def global_batch(x, mesh) -> jax.Array:
    """A host array that every process holds in full (token ids, n_valid, ...) → a global jax.Array,
    batch-split over `data`. Works single- and multi-process (each process supplies its shards)."""
    x = np.asarray(x)
    sh = batch_sharding(mesh, x.ndim, x.shape[0] if x.ndim else None) if x.ndim else NamedSharding(mesh, P())
    return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
    """Full value of a (possibly multi-process) global array as numpy, on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
