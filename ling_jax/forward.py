"""THE jitted cache-free forward: logits (and hidden states, routing, MTP logits) of whole sequences.

    out = forward(model, ids)                        # ids [B,T] int (host or device)
    out = forward(model, ids, n_valid=lens, mtp=True)

Works the same on one device and on a mesh: for a model loaded onto a mesh (`placement.model_mesh`),
the inputs are placed batch-split over `data` with `sharding.global_batch` (every process passes
the same host arrays; multi-process safe) and the outputs are gathered to every process.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling_jax.exec_config import ExecConfig
from ling_jax.placement import model_mesh
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
    the mesh the parameters live on decides the input placement.
    """
    ids = np.asarray(ids, np.int32) if not isinstance(ids, jax.Array) else ids.astype(jnp.int32)
    B, T = ids.shape
    nv = np.full((B,), T, np.int32) if n_valid is None else n_valid
    exec = exec if exec is not None else model.exec
    mesh = model_mesh(model)
    if mesh is not None:
        ids, nv = global_batch(np.asarray(ids), mesh), global_batch(np.asarray(nv, np.int32), mesh)
        if forced_routing is not None:
            forced_routing = {k: global_batch(np.asarray(v), mesh) for k, v in forced_routing.items()}
    else:
        ids, nv = jnp.asarray(ids), jnp.asarray(nv, jnp.int32)
    if T > exec.prefill_chunk:
        out = _chunked_forward(model, ids, nv, forced_routing, mtp, exec)
    else:
        out = _forward(model, ids, nv, forced_routing, mtp, exec)
    return jax.tree.map(lambda x: x if x.is_fully_addressable else to_host(x), out)


@nnx.jit(static_argnames=("mtp", "exec"), donate_argnames=("cache",))
def _forward_chunk(model, cache, ids, n_valid, forced_routing, mtp_ids, mtp: bool, exec):
    """One chunk [B,C] of a chunked forward through `cache` (holding the earlier chunks): the same
    outputs as `_forward` for these positions, plus the cache."""
    out = model(ids, cache, n_valid, mtp=mtp, mtp_ids=mtp_ids, exec=exec, forced_routing=forced_routing)
    return out["cache"], {k: out[k] for k in OUTPUTS if k in out}


def chunk_valid(n_valid, start: int, chunk: int):
    """[B] real tokens of each row inside the chunk [start, start + chunk) of a right-padded batch."""
    return jnp.clip(n_valid - start, 0, chunk).astype(jnp.int32)


def _chunked_forward(model, ids, n_valid, forced_routing, mtp: bool, exec: ExecConfig) -> dict:
    """`_forward` of a sequence longer than `exec.prefill_chunk`, as consecutive chunks of that many
    tokens through a cache (`model.init_cache`: KDA states carried exactly, MLA latents kept), so the
    activations (attention scores, MoE buffers, KDA chunk tensors) are those of one chunk, not of T.

    Why a cache and not one call: a cache-free call over T tokens holds [B,T,...] activations in
    every layer at once; here only the outputs ([B,T,V] logits) and the latent cache grow with T.
    The MTP inputs (tokens shifted left by one, spec §11) are formed over the whole sequence first,
    so a chunk's last slot pairs with the next chunk's first token. Same values as `_forward` (the
    cache path attends over the same keys; tests/test_long_context.py).
    """
    from ling_jax.model import init_cache

    B, T = ids.shape
    C = exec.prefill_chunk
    n_chunks = -(-T // C)
    pad = n_chunks * C - T
    ids_p = jnp.pad(ids, ((0, 0), (0, pad)))
    mtp_ids = None
    if mtp:
        t = jnp.arange(n_chunks * C)[None, :]
        nxt = jnp.concatenate([ids_p[:, 1:], jnp.zeros((B, 1), ids_p.dtype)], axis=1)
        mtp_ids = jnp.where(t + 1 < n_valid[:, None], nxt, 0)
    forced = None if forced_routing is None else {k: jnp.pad(v, ((0, 0), (0, pad), (0, 0)))
                                                  for k, v in forced_routing.items()}
    cache = init_cache(model.cfg, B, n_chunks * C, model.dtype, with_mtp=mtp)
    pieces = []
    for i in range(n_chunks):
        sl = slice(i * C, (i + 1) * C)
        cache, out = _forward_chunk(model, cache, ids_p[:, sl], chunk_valid(n_valid, i * C, C),
                                    None if forced is None else {k: v[:, sl] for k, v in forced.items()},
                                    None if mtp_ids is None else mtp_ids[:, sl], mtp, exec)
        pieces.append(out)
    del cache
    joined = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1)[:, :T], *pieces)
    return joined
