"""The model as three flat, string-keyed dicts of arrays: what the optimizer, Orbax and the step see.

`split_model` cuts a `LingForCausalLM` into
  params: trainable parameters (every `nnx.Param` except the MoE routers' `expert_bias`),
  bias:   the `expert_bias` vectors (moved by the aux-loss-free balancing rule, not by gradients),
  rest:   everything else (per-layer constants),
each keyed by the '/'-joined module path ('model/layers/0/attention/q_proj/weight'), plus the
graph definition and a key → path map to merge them back. Flat string keys keep the optimizer mask,
Orbax's files and the metrics readable, and make the state a plain pytree.
"""
from __future__ import annotations

from typing import Iterable

from flax import nnx

from ling_jax.checkpoint.layout import canonical_path
from ling_jax.config import LingConfig
from ling_jax.layer_stack import is_stacked_path, stacked_layer_paths
from ling_jax.model import LingForCausalLM

BIAS_NAME = "expert_bias"
TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains(BIAS_NAME)))
BIAS = nnx.All(nnx.Param, nnx.PathContains(BIAS_NAME))


def flatten_state(state) -> tuple[dict, dict]:
    """nnx.State → ({'a/b/0/c': array}, {'a/b/0/c': path tuple})."""
    flat, paths = {}, {}
    for path, var in nnx.to_flat_state(state):
        k = "/".join(str(p) for p in path)
        flat[k] = var.get_value() if hasattr(var, "get_value") else var
        paths[k] = tuple(path)
    return flat, paths


def unflatten(flat: dict, paths: dict) -> dict:
    """Flat dict → the nested pure dict `nnx.merge` accepts."""
    out: dict = {}
    for k, v in flat.items():
        d = out
        p = paths[k]
        for q in p[:-1]:
            d = d.setdefault(q, {})
        d[p[-1]] = v
    return out


def split_model(model: LingForCausalLM):
    """(graphdef, params, bias, rest, paths): params/bias/rest are flat dicts; paths maps every key."""
    graphdef, p, b, r = nnx.split(model, TRAINABLE, BIAS, ...)
    params, pp = flatten_state(p)
    bias, bp = flatten_state(b)
    rest, rp = flatten_state(r)
    return graphdef, params, bias, rest, {**pp, **bp, **rp}


def merge_model(graphdef, paths: dict, params: dict, bias: dict, rest: dict) -> LingForCausalLM:
    """The inverse of `split_model`: a model whose variables are the given arrays (not copied)."""
    return nnx.merge(graphdef, unflatten(params, paths), unflatten(bias, paths), unflatten(rest, paths))


def bias_layers(cfg: LingConfig, bias_keys: Iterable[str]) -> dict[int, tuple[str, tuple]]:
    """Decoder layer index (num_hidden_layers for MTP) → (its expert_bias key, index in that array):
    () for a layer stored on its own, (g, j) for one of a run stored stacked [repeats, n, E]
    (`ling_jax.layer_stack`)."""
    out = {}
    for k in bias_keys:
        p = k.split("/")
        if p[0] == "mtp":
            out[cfg.num_hidden_layers] = (k, ())
        elif is_stacked_path(p):
            for lp, g, j in stacked_layer_paths(p, cfg):
                out[int(lp[2])] = (k, (g, j))
        else:
            out[int(canonical_path(p)[2])] = (k, ())
    return out
