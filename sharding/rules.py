"""THE sharding rules: logical axis names → mesh axes, with the divisibility fallback.

Every parameter declares, where it is created, one *logical* axis name per dimension
(`nnx.Param(w, axes=("vocab", "embed"))`); every cache array gets its names from `CACHE_AXES`
below (caches are pytrees of the generation code, not module parameters). One rules object,
`RULES`, says which mesh axis (`sharding/mesh.py`: data, expert, model) each logical name is split
over; `spec(axes, shape, mesh, heads)` turns names into a PartitionSpec. Nothing here knows a
parameter's path or module: the model says what a dimension *is*, the rules say where it goes.

Logical names (`LOGICAL_AXES`, the whole vocabulary):

=============  ===========  ==============================================================
name           mesh axis    what the dimension is
=============  ===========  ==============================================================
vocab          model        vocabulary rows of the embedding and the LM head
embed          -            the hidden size D (activations are replicated along it)
embed_cat      model        the MTP projection's input [enorm(emb); hnorm(h)], 2·D wide
heads          model        H equal blocks of one attention head each (H·dk, H·dv, H, ...):
                            split only at head boundaries (see `heads=` below)
head_dim       -            one head's width (KDA's shared gated-norm weight)
q_lora         -            MLA query latent (q_lora_rank): shared by all heads
kv_lora        -            MLA key/value latent (kv_lora_rank [+ rope dims]): shared by all heads
conv           -            the short-conv taps (kernel size)
mlp            model        intermediate width of the dense FFN and the shared expert
expert         expert       the stacked routed experts
expert_mlp     model        a routed expert's intermediate width
router         -            the router's per-expert scores (every token scores every expert)
batch          data         sequences of a batch (caches, inputs)
layers         -            the [repeats, n] axes of a run's stacked layers (`ling_jax.layer_stack`)
=============  ===========  ==============================================================

A dimension is split over its mesh axis only when that axis has more than one device and the
dimension's size is divisible by it; for `heads` dimensions the head count (`heads=`, normally
`num_attention_heads`) must divide it too. Otherwise the dimension is REPLICATED along that axis:
nothing is padded, nothing is split unevenly, results stay exact and only memory grows. Each such
fallback is logged once (logger "sharding.rules"). Axes of size 1 resolve to None, so specs show
only real splits (and match what XLA reports back after a jit).
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Mapping, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding.mesh import mesh_sizes

log = logging.getLogger(__name__)


class UnknownParameterError(KeyError):
    """A parameter without logical axis names, an unknown logical name, or a cache array no rule covers."""

    def __str__(self):
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Logical axis name → mesh axis name (None: replicated); `head_split`: the names whose
    dimension consists of equal attention-head blocks (split only when the head count divides)."""
    mesh_axes: Mapping[str, Optional[str]]
    head_split: frozenset

    def mesh_axis(self, name: str, where: str = "") -> Optional[str]:
        if name not in self.mesh_axes:
            raise UnknownParameterError(
                f"sharding: unknown logical axis {name!r}{f' of {where}' if where else ''} "
                f"(known: {', '.join(sorted(self.mesh_axes))}; add it to sharding/rules.py RULES)")
        return self.mesh_axes[name]


LOGICAL_AXES: dict[str, Optional[str]] = {
    "vocab": "model", "embed": None, "embed_cat": "model", "heads": "model", "head_dim": None, "q_lora": None,
    "kv_lora": None, "conv": None, "mlp": "model", "expert": "expert", "expert_mlp": "model", "router": None,
    "batch": "data", "layers": None,
}
RULES = LogicalRules(LOGICAL_AXES, frozenset({"heads"}))

_WARNED: set = set()


def spec(axes, shape, mesh, heads: Optional[int] = None, *, rules: LogicalRules = RULES, where: str = "") -> P:
    """The PartitionSpec of an array of `shape` whose dimensions have the logical names `axes`.

    axes: one logical name (or None: replicated) per dimension; a leading `...` matches any number
    of extra leading dimensions, which stay replicated (layer-stacked caches `[repeats, n, B, ...]`).
    mesh: a Mesh, AbstractMesh or {axis: size} dict. heads: head count of `heads` dimensions (None:
    the dimension's own size). where: a name for error and fallback messages.
    """
    shape = tuple(int(d) for d in shape)
    axes = tuple(axes)
    if axes and axes[0] is Ellipsis:
        axes = axes[1:]
        if len(shape) < len(axes):
            raise ValueError(f"sharding: {where or 'array'} has shape {shape}, fewer dims than its axes {axes}")
        axes = (None,) * (len(shape) - len(axes)) + axes
    if len(axes) != len(shape):
        raise ValueError(f"sharding: {where or 'array'} has {len(shape)} dims {shape} but {len(axes)} logical "
                         f"axes {axes}")
    sizes = mesh_sizes(mesh)
    out, used = [], set()
    for d, name in zip(shape, axes):
        axis = None if name is None else rules.mesh_axis(name, where)
        n = sizes.get(axis, 1) if axis is not None else 1
        if n == 1:  # replicated, an absent axis or one of size 1: same layout, and what XLA reports back
            out.append(None)
            continue
        if axis in used:
            raise ValueError(f"sharding: {where or 'array'}: two dims {axes} map to mesh axis {axis!r}")
        blocks = (heads if heads is not None else d) if name in rules.head_split else d
        if d % n == 0 and blocks % n == 0:
            out.append(axis)
            used.add(axis)
            continue
        out.append(None)
        key = (name, axis, d, blocks, n)
        if key not in _WARNED:
            _WARNED.add(key)
            what = f"{blocks} heads" if name in rules.head_split else f"size {d}"
            log.warning("sharding: %s dimension (%s) not divisible by %s=%d: replicated along %s (e.g. %s %s)",
                        name, what, axis, n, axis, where or "an array", shape)
    return P(*out)


# ---------------------------------------------------------------------------------------------
# caches: pytrees of the generation code, named by their path in the HybridCache
# ---------------------------------------------------------------------------------------------
# (regex over the "/"-joined path below "cache/", logical axes); `...`: per-layer caches may be
# stacked with leading [repeats, n] dims (replicated). KDA state and conv states by head; the MLA
# latent has one KV head, so it is replicated over `model`.
CACHE_AXES: tuple[tuple[str, tuple], ...] = (
    (r"cache/layers/(?:\d+/)+recurrent", (..., "batch", "heads", None, None)),     # [B, H, dk, dv]
    (r"cache/layers/(?:\d+/)+conv_(?:q|k|v)", (..., "batch", None, "heads")),      # [B, K-1, H*dk]
    (r"cache/(?:layers/(?:\d+/)+|mtp/)(?:c|k_pe)", (..., "batch", None, None)),     # [B, S, 512] / [B, S, 64]
    (r"cache/(?:layers/(?:\d+/)+|mtp/)(?:c|k_pe)_scale", (..., "batch", None)),    # [B, S] FP8 cache scales
    (r"cache/lengths", ("batch",)),                                                # [B]
)
_CACHE = tuple((re.compile(p), a) for p, a in CACHE_AXES)


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def cache_axes(path) -> tuple:
    """Logical axes of the cache array at `path` ("cache/..." string or key path)."""
    s = path if isinstance(path, str) else path_str(path)
    for rx, axes in _CACHE:
        if rx.fullmatch(s):
            return axes
    raise UnknownParameterError(f"sharding: no cache rule for {s!r}; add one to sharding/rules.py CACHE_AXES")


def _cache_heads(cache) -> Optional[int]:
    """Head count from the first KDA state (its recurrent state is [..., B, H, dk, dv])."""
    for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
        if path_str(path).endswith("recurrent"):
            return int(x.shape[-3])
    return None


def cache_specs(cache, mesh, heads: Optional[int] = None):
    """Pytree of PartitionSpecs with the structure of a HybridCache (None leaves stay None)."""
    heads = heads if heads is not None else _cache_heads(cache)

    def one(path, x):
        s = "cache/" + path_str(path)
        return spec(cache_axes(s), x.shape, mesh, heads, where=s)
    return jax.tree_util.tree_map_with_path(one, cache)


def cache_shardings(cache, mesh, heads: Optional[int] = None):
    """Pytree of NamedShardings for a HybridCache (for `jax.device_put` / jit in/out_shardings).

    `cache` may hold arrays or ShapeDtypeStructs (e.g. `jax.eval_shape(init_cache, ...)`).
    """
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), cache_specs(cache, mesh, heads),
                                  is_leaf=lambda x: isinstance(x, P))
