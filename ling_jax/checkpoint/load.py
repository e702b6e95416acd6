"""Checkpoint tensors → the NNX parameter tree.

The module tree mirrors the checkpoint names, so the mapping is a path join plus three
structural differences: routed experts are stacked `[E, out, in]`, conv taps drop their middle
axis (`[P,1,K]` → `[P,K]`), and the MTP layer (`model.layers.{N}.*`) lives under `mtp` with its
attention/MLP block under `mtp.block`. Tensors are read one at a time (never the whole checkpoint).
"""
from __future__ import annotations

from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from ling_jax.config import LingConfig
from ling_jax.model import LingForCausalLM

_NP_DTYPE = {jnp.dtype(jnp.float32): np.float32, jnp.dtype(jnp.bfloat16): ml_dtypes.bfloat16}
_EXPERT_PROJ = {"gate_proj": True, "up_proj": True, "down_proj": True}


class ShapeOnlyRngs:
    """Stands in for nnx.Rngs while building a shape-only model: `params()` returns a fixed key.

    With a real nnx.Rngs every `params()` call updates a counter Variable with a tracer, and each
    update makes flax query the tracer's `.sharding`, which builds an error message whose cost grows
    with the whole trace: O(n^2) in the parameter count (~110 s for the full 73-layer model, ~3 s
    this way). Values are irrelevant under eval_shape; only shapes and dtypes are used.
    """

    def params(self):
        return jax.random.key(0)

    def __call__(self):
        return self.params()


def abstract_model(cfg: LingConfig, dtype=jnp.float32, with_mtp: bool = True) -> LingForCausalLM:
    """Shape-only LingForCausalLM: every variable a ShapeDtypeStruct. Parameters come from the
    checkpoint; the few non-parameter variables (SwiGLU limits) from `config_constant`."""
    return nnx.eval_shape(lambda: LingForCausalLM(cfg, dtype=jnp.dtype(dtype), rngs=ShapeOnlyRngs(),
                                                  with_mtp=with_mtp))


def checkpoint_names(path: tuple, cfg: LingConfig) -> tuple[str, list[str], Callable]:
    """For an NNX parameter path: (display name, checkpoint tensor names, assemble(arrays) -> array)."""
    p = [str(x) for x in path]
    if p[0] == "mtp":
        rest = p[2:] if p[1] == "block" else p[1:]
        p = ["model", "layers", str(cfg.num_hidden_layers)] + rest
    name = ".".join(p)
    ident = lambda arrs: arrs[0]
    if len(p) >= 2 and p[-2] == "experts" and p[-1] in _EXPERT_PROJ:
        prefix = ".".join(p[:-1])
        names = [f"{prefix}.{e}.{p[-1]}.weight" for e in range(cfg.num_experts)]
        return name, names, lambda arrs: np.stack(arrs)
    if p[-1] in ("q_conv1d", "k_conv1d", "v_conv1d"):
        return name, [name + ".weight"], lambda arrs: arrs[0].reshape(arrs[0].shape[0], -1)
    if p[-1] == "o_norm":
        return name, [name + ".weight"], ident
    return name, [name], ident


def read_param(reader, path: tuple, cfg: LingConfig, index=None, dtype=np.float32) -> np.ndarray:
    """One parameter, or the block `index` of it, read straight from the checkpoint (sharded loading).

    `index`: a tuple of slices over the *parameter's* shape (what `Sharding.devices_indices_map`
    gives), None for all of it. Only the bytes of that block are read: stacked experts `[E, out, in]`
    read just the experts in index[0], each as the sub-block of its `[out, in]` matrix;
    conv taps read rows of `[P, 1, K]`. FP8 tensors are dequantized (reader.get).
    """
    _, names, _ = checkpoint_names(path, cfg)
    p = [str(x) for x in path]
    if len(p) >= 2 and p[-2] == "experts" and p[-1] in _EXPERT_PROJ:
        e_sl, a_sl, b_sl = index if index is not None else (slice(None),) * 3
        sel = range(len(names))[e_sl]
        out = None
        for i, e in enumerate(sel):  # filled in place: one expert's block in flight, never a list + a stacked copy
            blk = reader.get(names[e], dtype=dtype, index=(a_sl, b_sl))
            if out is None:
                out = np.empty((len(sel),) + blk.shape, blk.dtype)
            out[i] = blk
        return out
    if p[-1] in ("q_conv1d", "k_conv1d", "v_conv1d"):
        r_sl, k_sl = index if index is not None else (slice(None),) * 2
        a = reader.get(names[0], dtype=dtype, index=(r_sl, slice(None), k_sl))
        return a.reshape(a.shape[0], -1)
    return reader.get(names[0], dtype=dtype, index=index)


def load_params(reader, cfg: LingConfig, dtype=jnp.float32, with_mtp: bool = True, progress: bool = True,
                place: Callable | None = None) -> LingForCausalLM:
    """Build a LingForCausalLM from a CheckpointReader-like object (`get(name, dtype) -> np.ndarray`).

    `place(path, np_array) -> jax.Array` puts each parameter on devices (default: `jnp.asarray`);
    the sharded loader passes its own.
    """
    dtype = jnp.dtype(dtype)
    graphdef, state = nnx.split(abstract_model(cfg, dtype, with_mtp))
    flat = list(nnx.to_flat_state(state))
    place = place or (lambda path, a: jnp.asarray(a))
    bar = tqdm(flat, desc="loading", unit="param", disable=not progress)
    for path, var in bar:
        if not isinstance(var, nnx.Param):  # config-derived constants (SwiGLU limits), not checkpoint tensors
            var.set_value(place(path, np.asarray(config_constant(path, cfg), np.float32)))
            continue
        name, names, assemble = checkpoint_names(path, cfg)
        want = var.get_value()  # ShapeDtypeStruct: the module decides each parameter's dtype
        arr = assemble([reader.get(n, dtype=np.float32) for n in names])
        if tuple(arr.shape) != tuple(want.shape):
            raise ValueError(f"{names[0]}: shape {tuple(arr.shape)} does not fit parameter {name} "
                             f"{tuple(want.shape)} expected from config.json")
        var.set_value(place(path, np.asarray(arr).astype(_NP_DTYPE.get(jnp.dtype(want.dtype), want.dtype))))
    bar.close()
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def config_constant(path: tuple, cfg: LingConfig) -> float:
    """Value of a non-parameter variable: the per-layer SwiGLU clamp limits (spec §7.2)."""
    p = [str(x) for x in path]
    layer = cfg.num_hidden_layers if p[0] == "mtp" else int(p[2])
    routed, shared = cfg.swiglu_limits(layer)
    if p[-1] == "routed_limit":
        return routed
    if p[-2:] == ["shared_experts", "limit"]:
        return shared
    raise ValueError(f"no config value for non-parameter variable {'/'.join(p)}")


def iter_param_names(cfg: LingConfig, with_mtp: bool = True) -> Iterator[str]:
    """Every checkpoint tensor name the model consumes (for validation and tests)."""
    for path, var in nnx.to_flat_state(nnx.split(abstract_model(cfg, with_mtp=with_mtp))[1]):
        if isinstance(var, nnx.Param):
            yield from checkpoint_names(path, cfg)[1]
