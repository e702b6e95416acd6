"""Placing a model, caches and inputs on a mesh by the partition rules."""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding.rules import cache_shardings, resolve


def attach_mesh(model, mesh):
    """Run `model` on `mesh`: its ExecConfig gets the mesh (routed experts then run expert-parallel).

    mesh=None (or a one-device mesh) goes back to the single-device MoE path. Returns `model`.
    """
    one = mesh is None or mesh.devices.size == 1
    model.exec = model.exec.replace(mesh=None if one else mesh)
    return model


def shard_model(model, mesh):
    """Place an already-loaded model's parameters on `mesh` by the rules (sharding/rules.py) and
    switch its MoE blocks to expert parallelism. Returns the same model object (updated in place).

    Single-process only for arbitrary inputs (`jax.device_put` of host-visible values); multi-host
    runs should load with `load_sharded` / `load_any`, which read only each process's slices.
    """
    cfg = model.cfg
    for path, var in nnx.to_flat_state(nnx.state(model)):  # Variables are shared with the model
        v = var.get_value()
        var.set_value(jax.device_put(v, NamedSharding(mesh, resolve(path, v.shape, mesh, cfg.num_attention_heads))))
    return attach_mesh(model, mesh)


def shard_cache(cache, mesh):
    """`jax.device_put` a HybridCache onto `mesh` by the cache rules."""
    return jax.device_put(cache, cache_shardings(cache, mesh))


def batch_sharding(mesh, ndim: int, batch: int | None = None) -> NamedSharding:
    """Batch (axis 0) over `data` when it divides evenly, everything else replicated."""
    n = dict(zip(mesh.axis_names, mesh.axis_sizes)).get("data", 1)
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
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


@nnx.jit(static_argnames=("mtp", "exec"))
def _logits(model, ids, n_valid, mtp: bool, exec=None):
    out = model(ids, n_valid=n_valid, mtp=mtp, exec=exec)
    return (out["logits"], out["mtp_logits"]) if mtp else (out["logits"],)


def sharded_logits(model, ids, mesh, mtp: bool = False, n_valid=None, exec=None):
    """Cache-free forward of host `ids` [B,T] on `mesh` (inputs batch-split over `data`); `exec`:
    the ExecConfig to run with (default the model's).

    Returns numpy (logits [B,T,V] f32[, mtp_logits]) on every process.
    """
    ids = np.asarray(ids, np.int32)
    nv = np.full((ids.shape[0],), ids.shape[1], np.int32) if n_valid is None else np.asarray(n_valid, np.int32)
    outs = _logits(model, global_batch(ids, mesh), global_batch(nv, mesh), mtp, exec)
    outs = tuple(to_host(o) for o in outs)
    return outs if mtp else outs[0]


@contextlib.contextmanager
def use_mesh(mesh):
    """`with use_mesh(mesh):` installs `mesh` as the context mesh (for MoE impl='ep' without a plan)."""
    with jax.set_mesh(mesh):
        yield mesh


def describe(model, mesh) -> list[tuple[str, tuple, P]]:
    """(path, shape, spec) of every parameter: what the rules give on `mesh` (for logs / `plan`)."""
    from sharding.rules import path_str

    out = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        v = var.get_value()
        out.append((path_str(path), tuple(v.shape), resolve(path, v.shape, mesh, model.cfg.num_attention_heads)))
    return out
