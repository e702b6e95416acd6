"""Checkpoint tensors → the NNX parameter tree.

The module tree mirrors the checkpoint names, so the mapping is a path join plus three
structural differences: routed experts are stacked `[E, in, out]`, conv taps drop their middle
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
        return name, names, lambda arrs: np.stack([a.T for a in arrs])
    if p[-1] in ("q_conv1d", "k_conv1d", "v_conv1d"):
        return name, [name + ".weight"], lambda arrs: arrs[0].reshape(arrs[0].shape[0], -1)
    if p[-1] == "o_norm":
        return name, [name + ".weight"], ident
    return name, [name], ident


def load_params(reader, cfg: LingConfig, dtype=jnp.float32, with_mtp: bool = True, progress: bool = True,
                place: Callable | None = None) -> LingForCausalLM:
    """Build a LingForCausalLM from a CheckpointReader-like object (`get(name, dtype) -> np.ndarray`).

    `place(path, np_array) -> jax.Array` puts each parameter on devices (default: `jnp.asarray`);
    the sharded loader passes its own.
    """
    dtype = jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: LingForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), with_mtp=with_mtp))
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    place = place or (lambda path, a: jnp.asarray(a))
    bar = tqdm(flat, desc="loading", unit="param", disable=not progress)
    for path, var in bar:
        name, names, assemble = checkpoint_names(path, cfg)
        want = var.get_value()  # ShapeDtypeStruct: the module decides each parameter's dtype
        arr = assemble([reader.get(n, dtype=np.float32) for n in names])
        if tuple(arr.shape) != tuple(want.shape):
            raise ValueError(f"{names[0]}: shape {tuple(arr.shape)} does not fit parameter {name} "
                             f"{tuple(want.shape)} expected from config.json")
        var.set_value(place(path, np.asarray(arr).astype(_NP_DTYPE.get(jnp.dtype(want.dtype), want.dtype))))
    bar.close()
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def iter_param_names(cfg: LingConfig, with_mtp: bool = True) -> Iterator[str]:
    """Every checkpoint tensor name the model consumes (for validation and tests)."""
    abstract = nnx.eval_shape(lambda: LingForCausalLM(cfg, rngs=nnx.Rngs(0), with_mtp=with_mtp))
    for path, _ in nnx.to_flat_state(nnx.split(abstract)[1]):
        yield from checkpoint_names(path, cfg)[1]
