"""THE partition-rule table: every parameter and cache array of the model gets its PartitionSpec here.

Paths are the NNX parameter paths joined with "/" (`model/layers/3/mlp/experts/gate_proj`,
`mtp/block/attention/kv_b_proj/weight`); cache arrays are addressed by their pytree path in the
HybridCache, e.g. `cache/layers/<i>/<field>` (or `cache/layers/<block>/<run>/<field>` for the
layer-stacked cache), `cache/mtp/<field>` and `cache/lengths` (KDAState / MLACache field names). The first
rule whose regex fully matches wins; a path no rule matches raises `UnknownParameterError`.

A spec entry per array dimension is
  None            - replicated along every mesh axis,
  "axis"          - split evenly over that mesh axis,
  "axis:heads"    - split over that axis at attention-head boundaries (the dimension is H equal
                    head blocks; only split when num_attention_heads is divisible by the axis size).
A rule whose first entry is `...` matches arrays with any number of extra LEADING dimensions, which
stay replicated (the layer-stacked caches `[repeats, n, B, ...]` of ling_jax.layer_stack; the entries
after `...` describe the trailing dims). An entry of `REPLICATED` for the whole rule means
"replicated, whatever the rank". Entries naming
an axis of size 1 (or one the mesh lacks) resolve to None, so specs show only real splits.

Divisibility fallback (documented rule): a dimension whose size - or, for ":heads" entries, whose
head count - is not divisible by the mesh axis size is REPLICATED along that axis instead (its
entry becomes None). Nothing is padded and nothing is split unevenly; the model stays correct, it
only uses more memory. Each fallback is logged once (logger "sharding.rules").
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

REPLICATED = "replicated"
_L = r"(?:model/layers/\d+|mtp/block)"  # a decoder layer (main stack or the MTP layer's block)

# (regex over the "/"-joined path, spec per dimension). Order matters only where noted.
RULES: tuple[tuple[str, Any], ...] = (
    # embeddings / LM head: vocabulary rows over `model`
    (r"model/word_embeddings/weight", ("model", None)),
    (r"lm_head/weight", ("model", None)),
    # RMSNorm weights (1-D): replicated
    (rf"model/norm/weight|mtp/(?:enorm|hnorm|final_layernorm)/weight"
     rf"|{_L}/(?:input_layernorm|post_attention_layernorm)/weight"
     rf"|{_L}/attention/(?:q_a_layernorm|kv_a_layernorm)/weight", REPLICATED),
    # KDA: q/k/v/f/g/b projections [H*dk or H, D] split by head rows; o_proj [D, H*dv] by columns;
    # conv taps [H*dk, K], dt_bias [H*dk] and A_log [H] follow their heads; o_norm [dk] is shared.
    # (MLA's head-wise g_proj [H, D] and a LoRA-free q_proj [H*192, D] match the same rule.)
    (rf"{_L}/attention/(?:q|k|v|f|g|b)_proj/weight", ("model:heads", None)),
    (rf"{_L}/attention/o_proj/weight", (None, "model:heads")),
    (rf"{_L}/attention/(?:q|k|v)_conv1d", ("model:heads", None)),
    (rf"{_L}/attention/(?:dt_bias|A_log)", ("model:heads",)),
    (rf"{_L}/attention/o_norm", REPLICATED),
    # MLA: the latent down-projections are shared by all heads (replicated); the per-head
    # up-projections q_b [H*192, q_lora] and kv_b [H*256, 512] split by head rows, dense by columns.
    (rf"{_L}/attention/(?:q_a_proj|kv_a_proj_with_mqa)/weight", REPLICATED),
    (rf"{_L}/attention/(?:q_b_proj|kv_b_proj)/weight", ("model:heads", None)),
    (rf"{_L}/attention/dense/weight", (None, "model:heads")),
    # MoE: router replicated (every token scores every expert); routed experts [E, I, D] / [E, D, I]
    # split over `expert`, their intermediate width I over `model` (FP8 scales likewise).
    (rf"{_L}/mlp/gate/(?:weight|expert_bias)", REPLICATED),
    (rf"{_L}/mlp/experts/(?:gate_proj|up_proj)(?:_scale)?", ("expert", "model", None)),
    (rf"{_L}/mlp/experts/down_proj(?:_scale)?", ("expert", None, "model")),
    # dense FFN and shared expert: intermediate width over `model`
    (rf"{_L}/mlp/(?:shared_experts/)?(?:gate_proj|up_proj)/weight", ("model", None)),
    (rf"{_L}/mlp/(?:shared_experts/)?down_proj/weight", (None, "model")),
    # per-layer SwiGLU clamp limits (scalar constants, not parameters)
    (rf"{_L}/mlp/(?:routed_limit|(?:shared_experts/)?limit)", REPLICATED),
    # MTP input projection [D, 2D]: input columns over `model`
    (r"mtp/eh_proj/weight", (None, "model")),
    # FP8-kept projections (`--keep-fp8`, ling_jax.linear.FP8Linear): the float8 weight is split by the
    # rule of its `.../weight` above; its block-scale grid [ceil(out/128), ceil(in/128)] is REPLICATED.
    # It is 1/4096 of the weight's bytes, and a split of the weight need not fall on 128-row/column
    # block boundaries (12 heads x 192 rows over model=4: 576 rows = 4.5 blocks each); inside jit,
    # GSPMD uses the slice of the expanded scale that matches each device's weight block.
    (rf"{_L}/attention/(?:(?:q|k|v|f|g|b|o|q_a|q_b|kv_b)_proj|kv_a_proj_with_mqa|dense)/weight_scale_inv",
     REPLICATED),
    (rf"{_L}/mlp/(?:shared_experts/)?(?:gate|up|down)_proj/weight_scale_inv", REPLICATED),
    (r"mtp/eh_proj/weight_scale_inv", REPLICATED),
    # ---- caches: batch over `data`; KDA state and conv states by head; MLA latent replicated over `model`.
    # `...`: per-layer caches may be stacked with leading [repeats, n] dims (replicated).
    (r"cache/layers/(?:\d+/)+recurrent", (..., "data", "model:heads", None, None)),    # [B, H, dk, dv]
    (r"cache/layers/(?:\d+/)+conv_(?:q|k|v)", (..., "data", None, "model:heads")),     # [B, K-1, H*dk]
    (r"cache/(?:layers/(?:\d+/)+|mtp/)(?:c|k_pe)", (..., "data", None, None)),        # [B, S, 512] / [B, S, 64]
    (r"cache/lengths", ("data",)),                                                    # [B]
)
_COMPILED = tuple((re.compile(p), s) for p, s in RULES)
_WARNED: set = set()


class UnknownParameterError(KeyError):
    """A parameter / cache path that no partition rule covers."""

    def __str__(self):
        return str(self.args[0])


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def rule_for(path) -> tuple[str, Any]:
    """(pattern, spec entries) of the first rule matching `path` (tuple or "/"-string)."""
    s = path if isinstance(path, str) else path_str(path)
    for rx, spec in _COMPILED:
        if rx.fullmatch(s):
            return rx.pattern, spec
    raise UnknownParameterError(f"sharding: no partition rule for {s!r}; add one to sharding/rules.py RULES "
                                f"(every parameter and cache array must have an explicit rule)")


def _sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def resolve(path, shape, mesh, heads: Optional[int]) -> P:
    """The PartitionSpec of an array of `shape` at `path` on `mesh`, with the divisibility fallback."""
    s = path if isinstance(path, str) else path_str(path)
    pattern, entries = rule_for(s)
    shape = tuple(shape)
    if entries == REPLICATED:
        return P(*([None] * len(shape)))
    if entries and entries[0] is Ellipsis:
        entries = entries[1:]
        if len(shape) < len(entries):
            raise ValueError(f"sharding: rule {pattern!r} needs at least {len(entries)} dims but {s} has shape {shape}")
        entries = (None,) * (len(shape) - len(entries)) + tuple(entries)
    if len(entries) != len(shape):
        raise ValueError(f"sharding: rule {pattern!r} has {len(entries)} dims but {s} has shape {shape}")
    sizes = _sizes(mesh)
    out = []
    for d, e in zip(shape, entries):
        if e is None:
            out.append(None)
            continue
        axis, _, unit = e.partition(":")
        n = sizes.get(axis, 1)
        if n == 1:  # absent or size-1 axis: same layout as replicated, and what XLA reports back
            out.append(None)
            continue
        blocks = d if unit != "heads" else (heads if heads is not None else d)
        if d % n == 0 and blocks % n == 0:
            out.append(axis)
        else:
            out.append(None)
            key = (pattern, axis, d, n)
            if key not in _WARNED:
                _WARNED.add(key)
                what = f"{blocks} heads" if unit == "heads" else f"size {d}"
                log.warning("sharding: %s (%s) not divisible by %s=%d: replicated along %s (e.g. %s %s)",
                            pattern, what, axis, n, axis, s, shape)
    return P(*out)


def named(mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, spec)


# ---------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------
def param_specs(state, mesh, cfg) -> dict[tuple, P]:
    """{NNX path tuple: PartitionSpec} for every Variable of an nnx State (or a Module)."""
    from flax import nnx

    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    out = {}
    for path, var in nnx.to_flat_state(state):
        v = var.get_value() if hasattr(var, "get_value") else var
        out[tuple(path)] = resolve(path, v.shape, mesh, cfg.num_attention_heads)
    return out


def param_shardings(state, mesh, cfg) -> dict[tuple, NamedSharding]:
    return {k: NamedSharding(mesh, s) for k, s in param_specs(state, mesh, cfg).items()}


# ---------------------------------------------------------------------------------------------
# caches
# ---------------------------------------------------------------------------------------------
def _cache_heads(cache) -> Optional[int]:
    """Head count from the first KDA state (its recurrent state is [..., B, H, dk, dv])."""
    for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
        if path_str(path).endswith("recurrent"):
            return int(x.shape[-3])
    return None


def cache_specs(cache, mesh, heads: Optional[int] = None):
    """Pytree of PartitionSpecs with the structure of a HybridCache (None leaves stay None)."""
    heads = heads if heads is not None else _cache_heads(cache)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: resolve("cache/" + path_str(path), x.shape, mesh, heads), cache)


def cache_shardings(cache, mesh, heads: Optional[int] = None):
    """Pytree of NamedShardings for a HybridCache (for `jax.device_put` / jit in/out_shardings).

    `cache` may hold arrays or ShapeDtypeStructs (e.g. `jax.eval_shape(init_cache, ...)`).
    """
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), cache_specs(cache, mesh, heads),
                                  is_leaf=lambda x: isinstance(x, P))


# ---------------------------------------------------------------------------------------------
# the expert-parallel plan handed to ling_jax.moe
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EPPlan:
    """What `ling_jax.moe.experts_ep` needs: the mesh and the specs the expert weights were placed
    with, in the order (gate, up, down[, gate_scale, up_scale, down_scale]). Hashable (static)."""
    mesh: Any
    specs: tuple

    def __repr__(self):
        return f"EPPlan({_sizes(self.mesh)}, gate={self.specs[0]}, down={self.specs[2]})"


def expert_shapes(cfg, fp8: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out = [("gate_proj", (E, I, D)), ("up_proj", (E, I, D)), ("down_proj", (E, D, I))]
    if fp8:
        bo, bi = cfg.weight_block_size
        out += [("gate_proj_scale", (E, I, -(-D // bi))), ("up_proj_scale", (E, I, -(-D // bi))),
                ("down_proj_scale", (E, -(-D // bo), I))]
    return out


def ep_plan(mesh, cfg, fp8: bool = False) -> EPPlan:
    specs = tuple(resolve(f"model/layers/0/mlp/experts/{n}", shp, mesh, cfg.num_attention_heads)
                  for n, shp in expert_shapes(cfg, fp8))
    return EPPlan(mesh, specs)


def context_ep_plan(cfg, fp8: bool = False) -> EPPlan:
    """EP plan for the mesh installed with `jax.set_mesh(mesh)` (used by `impl="ep"` without a plan)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("moe impl='ep' needs a mesh: place the model with sharding.shard_model / "
                         "load_sharded, or run under `with jax.set_mesh(mesh):`")
    return ep_plan(mesh, cfg, fp8)
