"""THE jitted cache-free forward: logits (and hidden states, routing, MTP logits) of whole sequences.

    out = forward(model, ids)                        # ids [B,T] int (host or device)
    out = forward(model, ids, n_valid=lens, mtp=True)

Works the same on one device and on a mesh: for a model loaded onto a mesh (`model.exec.mesh`),
the inputs are placed batch-split over `data` with `sharding.global_batch` (every process passes
the same host arrays; multi-process safe) and the outputs are gathered to every process.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling_jax.exec_config import ExecConfig
from sharding.place import global_batch, to_host

OUTPUTS = ("logits", "mtp_logits", "hidden", "routing")


@nnx.jit(static_argnames=("mtp", "exec"))
def _forward(model, ids, n_valid, forced_routing, mtp: bool, exec):
    out = model(ids, n_valid=n_valid, mtp=mtp, exec=exec, forced_routing=forced_routing)
    return {k: out[k] for k in OUTPUTS if k in out}


def forward(model, ids, *, n_valid=None, mtp: bool = False, forced_routing=None,
            exec: ExecConfig | None = None) -> dict:
    """Cache-free forward of `ids` [B,T] (right-padded: `n_valid[b]` real tokens, default T).

    Returns {"logits": [B,T,V] f32, "hidden": [B,T,D] (final-normed), "routing": {layer: [B,T,k]}
    (routed expert ids), "mtp_logits": [B,T,V] f32 when mtp}. `forced_routing` ({layer: [B,T,k]},
    e.g. another forward's "routing") pins the experts. Values are jax.Arrays when this process can
    address them fully (one process), else NumPy arrays gathered to every process.
    `exec`: an ExecConfig overriding `model.exec` (e.g. `model.exec.replace(kernels="pallas")`);
    its mesh (a model loaded onto a mesh) decides the input placement.
    """
    ids = np.asarray(ids, np.int32) if not isinstance(ids, jax.Array) else ids.astype(jnp.int32)
    B, T = ids.shape
    nv = np.full((B,), T, np.int32) if n_valid is None else n_valid
    exec = exec if exec is not None else model.exec
    mesh = exec.mesh
    if mesh is not None:
        ids, nv = global_batch(np.asarray(ids), mesh), global_batch(np.asarray(nv, np.int32), mesh)
        if forced_routing is not None:
            forced_routing = {k: global_batch(np.asarray(v), mesh) for k, v in forced_routing.items()}
    else:
        ids, nv = jnp.asarray(ids), jnp.asarray(nv, jnp.int32)
    out = _forward(model, ids, nv, forced_routing, mtp, exec)
    return jax.tree.map(lambda x: x if x.is_fully_addressable else to_host(x), out)
