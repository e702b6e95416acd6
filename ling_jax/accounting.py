"""Parameter, byte and cache accounting for Ling-3.1-flash configs (pure functions, no files).

Everything here is computed from a `LingConfig` through the tensor inventory of
`ling_jax.checkpoint.layout.expected_tensors`, or (for `ling-jax inspect`) from safetensors header
entries; both paths go through the same `summarize()` so they group and count identically.

Groups (spec §12; the grouping of the seed article's header audit):

==================  ==========================================================================
routed_experts      ``mlp.experts.{e}.*`` of the main MoE layers
kda_attention       every tensor under ``attention.`` of a main KDA layer: the six projections,
                    ``b_proj``, conv taps, ``A_log``, ``dt_bias``, ``o_norm`` (the seed puts the
                    convs and small gate parts here: its 12.71 B needs the 6.2 M conv taps)
shared_experts      ``mlp.shared_experts.*`` of the main MoE layers
mla_attention       every tensor under ``attention.`` of a main MLA layer (incl. the
                    ``q_a``/``kv_a`` layernorms)
dense_ffn           ``mlp.{gate,up,down}_proj`` of the first ``first_k_dense_replace`` layers
embed_head          ``model.word_embeddings`` and ``lm_head`` (untied)
routers_norms       routers ``mlp.gate.weight`` + ``mlp.gate.expert_bias``, the per-layer
                    ``input``/``post_attention`` layernorms and the final ``model.norm``
mtp                 everything stored under ``model.layers.{N}.`` with N = num_hidden_layers
other               anything not recognised (only possible for foreign checkpoints)
scales              (bytes only) every ``*.weight_scale_inv`` / ``*.weight_scale`` tensor: block
                    scales are storage, not parameters
==================  ==========================================================================

Active parameters per token (main model): every main-model parameter except the routed experts and
the input embedding (a row lookup, not a matmul), plus ``num_experts_per_tok / num_experts`` of the
routed experts. For the real config that is 24,250,707,776 (spec §0); adding the 643,825,664
embedding rows gives the published 24.89 B (``active_with_embedding``).

Weight formats (``weight_bytes``):

* ``bf16``  — 2 bytes for every parameter, no scales (1,065.66 GiB for the real model with MTP).
* ``fp8``   — the release format: FP8-E4M3 matrices (1 byte) plus one float32 scale per 128×128
  block (ceil-sized grid); unquantized tensors at their release dtype: BF16, except ``A_log``,
  ``dt_bias``, ``expert_bias`` and the conv taps, which are FP32.
* ``mxfp4`` — routed experts (main and MTP) at 4.25 bits/weight (4-bit E2M1 values plus one
  8-bit E8M0 scale per 32 inputs, stored as a separate ``weight_scale_inv`` tensor -- the name
  Ling's checkpoints use; vLLM renames it ``weight_scale``, also recognised), everything else as
  in ``fp8``.

Which matrices the *release* stores unquantized (spec §12.7, open question §16.4): the tensor
count forces exactly one BF16 matrix per KDA layer (``b_proj``) and one per MLA layer, either the
head-wise ``g_proj`` ("Layout B", the default of `layout.py` and our writer) or ``kv_a_proj_with_mqa``
("Layout A"); the split is defined once, in ``layout.BF16_MATRICES``, and used here through
``layout.expected_tensors(..., fp8_layout=...)`` exactly as the writer uses it. The spec leaves
the choice to whether the published 573,753,281,152-byte total counts the safetensors JSON headers;
the seed article that measured it says it is the sum of the header *tensor* entries, equal to the
index's ``total_size`` (no headers; and its 16.9 MB of JSON would not close Layout B's gap anyway).
With FP32 conv taps:

* Layout A: 573,753,349,632 B = **534.35 GiB** (68,480 B above the published total);
  MXFP4 experts: 313,151,411,712 B = **291.64 GiB** — both published figures reproduced.
* Layout B: 573,732,383,232 B = 534.33 GiB (20.9 MB short); MXFP4: 291.63 GiB.
* BF16 conv taps lower either by 12,386,304 B (Layout A: 534.34 GiB).

The seed's third row ("MTP layer dropped", 287.51 GiB) is the one figure Layout A does not give
(287.54 GiB here): it equals the main-model payload of Layout B with BF16 conv taps, a layout whose
full-model payload is 534.32 GiB, 33.3 MB short of the published total. The seed's own numbers are
therefore not all from one layout; we follow the two published, measured-derived totals.

So the release-format defaults here are ``RELEASE_FP8_LAYOUT = "A"`` and
``RELEASE_CONV_DTYPE = "F32"``; pass ``fp8_layout="B"`` (or ``None`` = the writer's default layout,
``layout.DEFAULT_FP8_LAYOUT``) to account for the other layout. A header-only checkpoint written with
``ling-jax make-checkpoint --config config.ling-3.1-flash.json --out DIR --header-only
--fp8-layout A --conv-dtype F32`` makes ``ling-jax inspect DIR`` report the same 534.35 GiB.
"""
from __future__ import annotations

import copy
import functools
import json
import math
from fractions import Fraction
from typing import Iterable, NamedTuple, Optional

from flax import nnx

from ling_jax.checkpoint import layout as L
from ling_jax.checks import check_int
from ling_jax.checkpoint.blocks import fp8_block, release_fp8, release_mxfp4
from ling_jax.config import KDA, MLA, LingConfig
from ling_jax.loader import abstract_model, param_layout
from ling_jax.placement import block_fp8_specs, mxfp4_spec, param_specs
from ling_jax.quantized import is_quantized
from sharding.mesh import parse_mesh_shape
from sharding.rules import cache_axes, spec

GiB = 1 << 30
MiB = 1 << 20

FORMATS = ("bf16", "fp8", "mxfp4")
FP8_LAYOUTS = L.FP8_LAYOUTS
RELEASE_FP8_LAYOUT = "A"
RELEASE_CONV_DTYPE = "F32"
MXFP4_GROUP = 32          # inputs sharing one E8M0 scale
MXFP4_SCALE_SUFFIX = ".weight_scale"
MXFP4_DTYPES = ("MXFP4", "U8", "F8_E8M0")  # stored dtypes of MXFP4 expert codes / scales

GROUPS = ("routed_experts", "kda_attention", "shared_experts", "mla_attention", "dense_ffn",
          "embed_head", "routers_norms", "mtp", "other")
GROUP_TITLES = {
    "routed_experts": "Routed experts",
    "kda_attention": "KDA attention",
    "shared_experts": "Shared experts",
    "mla_attention": "MLA attention",
    "dense_ffn": "Dense FFN",
    "embed_head": "Embeddings + lm_head",
    "routers_norms": "Routers and norms",
    "mtp": "MTP layer",
    "other": "Other",
    "scales": "Block scales",
}
SCALE_SUFFIXES = (L.SCALE_SUFFIX, MXFP4_SCALE_SUFFIX)
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8,
               "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "BOOL": 1}

_LAYER_PREFIX = "model.layers."
_EXPERT_PREFIX = "mlp.experts."
_EMBED_NAMES = ("model.word_embeddings.weight", "model.embed_tokens.weight")
# attention sub-modules that only MLA layers have (g_proj, and q_proj without q_lora, exist in both)
_MLA_ONLY = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
             "kv_b_proj", "dense")


# ---------------------------------------------------------------------------------------------
# stored tensors
# ---------------------------------------------------------------------------------------------
class Stored(NamedTuple):
    """One stored tensor: name, logical shape, bytes on disk, dtype, and whether it is a scale."""

    name: str
    shape: tuple
    nbytes: int
    dtype: str = ""
    scale: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (expected one of: {', '.join(FORMATS)})")
    return fmt


def _check_layout(fp8_layout: Optional[str]) -> Optional[str]:
    if fp8_layout is not None and fp8_layout not in FP8_LAYOUTS:
        raise ValueError(f"unknown fp8 layout {fp8_layout!r} (expected A, B or None)")
    return fp8_layout


def stored_tensors(cfg: LingConfig, fmt: str = "fp8", include_mtp: bool = True,
                   fp8_layout: Optional[str] = RELEASE_FP8_LAYOUT,
                   conv_dtype: str = RELEASE_CONV_DTYPE) -> list[Stored]:
    """Every tensor a checkpoint of `cfg` in weight format `fmt` would store (scales included).
    Memoized per arguments (the real config's 214K tensors take ~1 s to list, and `plan` lists them
    twice per call; a LingConfig is hashable; a caller may change its list, not the memo)."""
    _check_format(fmt)
    _check_layout(fp8_layout)
    return list(_stored_tensors(cfg, fmt, include_mtp, fp8_layout, conv_dtype))


@functools.lru_cache(maxsize=8)
def _stored_tensors(cfg: LingConfig, fmt: str, include_mtp: bool, fp8_layout: Optional[str],
                    conv_dtype: str) -> tuple[Stored, ...]:
    block = tuple(cfg.weight_block_size or (128, 128))
    out: list[Stored] = []
    # which matrices are FP8: `layout.BF16_MATRICES`, through expected_tensors (the writer's source)
    specs = L.expected_tensors(cfg, include_mtp, conv_dtype=conv_dtype,
                               fp8_layout=fp8_layout or L.DEFAULT_FP8_LAYOUT)
    for name, s in specs.items():
        n = s.numel
        if fmt == "bf16":
            out.append(Stored(name, s.shape, 2 * n, "BF16"))
            continue
        if not s.quantizable:
            out.append(Stored(name, s.shape, DTYPE_BYTES[s.dtype] * n, s.dtype))
            continue
        o, i = s.shape
        if fmt == "mxfp4" and ".mlp.experts." in name:
            groups = -(-i // MXFP4_GROUP)
            out.append(Stored(name, s.shape, o * -(-i // 2), "MXFP4"))  # two E2M1 values per byte
            # stored as our writer / `ling-jax quantize` store it (Ling's names: `weight_scale_inv`,
            # U8 E8M0 bytes; see `checkpoint.mxfp4`)
            out.append(Stored(L.scale_name(name), (o, groups), o * groups, "U8", scale=True))
            continue
        grid = (-(-o // block[0]), -(-i // block[1]))
        out.append(Stored(name, s.shape, n, "F8_E4M3"))
        out.append(Stored(L.scale_name(name), grid, 4 * grid[0] * grid[1], "F32", scale=True))
    return tuple(out)


def detect_fp8_layout(tensors: Iterable[Stored]) -> Optional[str]:
    """Which FP8 layout of spec §12.7 stored tensors follow, read off their dtypes: "A" or "B" when
    every attention matrix that either layout of ``layout.BF16_MATRICES`` keeps BF16 is FP8 exactly
    where that layout says (MTP layer included); None when no such matrix is FP8 or neither fits.
    (For reporting only: the reader dequantises by dtype + ``weight_scale_inv``, never by layout.)"""
    parsed = [(t, *_split_layer(t.name)) for t in tensors if not t.scale]
    mla = _mla_layers((t.name, layer, rest) for t, layer, rest in parsed)
    candidates = {kind: {m for x in FP8_LAYOUTS for m in L.BF16_MATRICES[x][kind]} for kind in (KDA, MLA)}
    seen = {}  # (kind, module) -> set of "stored FP8" flags over the layers
    for t, layer, rest in parsed:
        if layer is None or not rest.startswith("attention.") or not rest.endswith(".weight"):
            continue
        kind = MLA if layer in mla else KDA
        m = rest[len("attention."):-len(".weight")]
        if m in candidates[kind]:
            seen.setdefault((kind, m), set()).add(t.dtype.startswith("F8_"))
    if not any(True in v for v in seen.values()):
        return None
    for x in FP8_LAYOUTS:
        if all(v == {m not in L.BF16_MATRICES[x][kind]} for (kind, m), v in seen.items()):
            return x
    return None


# ---------------------------------------------------------------------------------------------
# grouping and summary (shared by config accounting and `inspect`)
# ---------------------------------------------------------------------------------------------
def _split_layer(name: str) -> tuple[Optional[int], str]:
    """`model.layers.12.mlp.gate.weight` -> (12, "mlp.gate.weight"); (None, name) for globals."""
    if name.startswith(_LAYER_PREFIX):
        idx, _, rest = name[len(_LAYER_PREFIX):].partition(".")
        if idx.isdigit() and rest:
            return int(idx), rest
    return None, name


def _mla_layers(parsed) -> set:
    return {layer for _, layer, rest in parsed
            if layer is not None and rest.startswith("attention.") and rest.split(".")[1] in _MLA_ONLY}


def classify(names: Iterable[str], num_hidden_layers: Optional[int]) -> dict[str, str]:
    """Group of every non-scale tensor name (see the module docstring).

    Layer types are read off the names (a layer holding any MLA-only attention tensor is MLA), so
    this works on a checkpoint without its config. `num_hidden_layers=None`: no MTP layer.
    """
    parsed = [(n, *_split_layer(n)) for n in names if not is_scale_name(n)]
    mla = _mla_layers(parsed)
    return {n: _group(n, layer, rest, mla, num_hidden_layers) for n, layer, rest in parsed}


def _group(name: str, layer: Optional[int], rest: str, mla_layers: set, n_main: Optional[int]) -> str:
    if layer is None:
        if name in _EMBED_NAMES or name == "lm_head.weight":
            return "embed_head"
        return "routers_norms" if name == "model.norm.weight" else "other"
    if n_main is not None and layer >= n_main:
        return "mtp"
    if rest.startswith(_EXPERT_PREFIX):
        return "routed_experts"
    if rest.startswith("attention."):
        return "mla_attention" if layer in mla_layers else "kda_attention"
    if rest.startswith("mlp.shared_experts."):
        return "shared_experts"
    if rest.startswith("mlp.gate."):
        return "routers_norms"
    if rest.startswith("mlp.") and rest.split(".")[1] in ("gate_proj", "up_proj", "down_proj"):
        return "dense_ffn"
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return "routers_norms"
    return "other"


def summarize(tensors: Iterable[Stored], num_hidden_layers: Optional[int],
              num_experts_per_tok: Optional[int]) -> dict:
    """Parameter and byte totals by group, plus active parameters per token.

    `tensors`: stored tensors, scale tensors flagged (`is_scale_name`). `num_hidden_layers`: tensors
    of layer index >= it are the MTP layer (None: no MTP layer). `num_experts_per_tok=None`: active
    counts are not computed (None).
    """
    tensors = list(tensors)
    parsed = [(t, *_split_layer(t.name)) for t in tensors]
    mla = _mla_layers((t.name, layer, rest) for t, layer, rest in parsed)
    params = {g: 0 for g in GROUPS}
    nbytes = {g: 0 for g in GROUPS}
    nbytes["scales"] = 0
    part_bytes = {"main": 0, "mtp": 0}
    embedding = n_scales = 0
    # per MoE layer: routed params and the set of expert indices (MTP layer included)
    routed_layer: dict[int, int] = {}
    experts_layer: dict[int, set] = {}
    for t, layer, rest in parsed:
        mtp = layer is not None and num_hidden_layers is not None and layer >= num_hidden_layers
        part_bytes["mtp" if mtp else "main"] += t.nbytes
        if t.scale:
            nbytes["scales"] += t.nbytes
            n_scales += 1
            continue
        g = _group(t.name, layer, rest, mla, num_hidden_layers)
        n = math.prod(t.shape)
        params[g] += n
        nbytes[g] += t.nbytes
        if t.name in _EMBED_NAMES:
            embedding += n
        elif layer is not None and rest.startswith(_EXPERT_PREFIX):
            e = rest[len(_EXPERT_PREFIX):].partition(".")[0]
            routed_layer[layer] = routed_layer.get(layer, 0) + n
            experts_layer.setdefault(layer, set()).add(e)
    main = sum(v for g, v in params.items() if g != "mtp")
    out_params = {"main": main, "mtp": params["mtp"], "total": main + params["mtp"],
                  "active": None, "active_with_embedding": None, "mtp_active": None,
                  "embedding": embedding, "by_group": params}
    if num_experts_per_tok is not None:
        k = int(num_experts_per_tok)

        def active_routed(layers):
            return sum(Fraction(routed_layer[l] * min(k, len(experts_layer[l])), len(experts_layer[l]))
                       for l in layers)

        main_layers = [l for l in routed_layer if num_hidden_layers is None or l < num_hidden_layers]
        mtp_layers = [l for l in routed_layer if l not in main_layers]
        active = main - params["routed_experts"] - embedding + active_routed(main_layers)
        out_params["active"] = int(round(active))
        out_params["active_with_embedding"] = int(round(active + embedding))
        if params["mtp"]:
            mtp_routed = sum(routed_layer[l] for l in mtp_layers)
            out_params["mtp_active"] = int(round(params["mtp"] - mtp_routed + active_routed(mtp_layers)))
    total_bytes = sum(nbytes.values())
    return {
        "params": out_params,
        "bytes": {"total": total_bytes, **nbytes},
        "bytes_by_part": part_bytes,
        "total_gib": total_bytes / GiB,
        "num_tensors": len(tensors),
        "num_scale_tensors": n_scales,
    }


# ---------------------------------------------------------------------------------------------
# config-level API
# ---------------------------------------------------------------------------------------------
_SUMMARY_CACHE: dict = {}


def summary(cfg: LingConfig, fmt: str = "fp8", include_mtp: bool = True,
            fp8_layout: Optional[str] = RELEASE_FP8_LAYOUT, conv_dtype: str = RELEASE_CONV_DTYPE) -> dict:
    """`summarize()` of the tensors a checkpoint of `cfg` in format `fmt` stores, plus
    "routed_bytes" (routed experts of main and MTP layers, scales included). Memoized."""
    _check_format(fmt)
    _check_layout(fp8_layout)
    key = (json.dumps(cfg.to_dict(), sort_keys=True, default=str), fmt, bool(include_mtp), fp8_layout, conv_dtype)
    hit = _SUMMARY_CACHE.get(key)
    if hit is None:
        tensors = stored_tensors(cfg, fmt, include_mtp, fp8_layout, conv_dtype)
        hit = summarize(tensors, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        hit["routed_bytes"] = sum(t.nbytes for t in tensors if ".mlp.experts." in t.name)
        if len(_SUMMARY_CACHE) > 32:
            _SUMMARY_CACHE.clear()
        _SUMMARY_CACHE[key] = hit
    return copy.deepcopy(hit)


def param_counts(cfg: LingConfig, include_mtp: bool = True) -> dict:
    """`summarize(...)["params"]` for `cfg`: main / mtp / total / active (+ `by_group`)."""
    return summary(cfg, "bf16", include_mtp)["params"]


def weight_bytes(cfg: LingConfig, fmt: str = "fp8", include_mtp: bool = True,
                 fp8_layout: Optional[str] = RELEASE_FP8_LAYOUT, conv_dtype: str = RELEASE_CONV_DTYPE) -> dict:
    """Bytes of the weights of `cfg` in format `fmt`: {"total", <group>..., "scales"}."""
    return summary(cfg, fmt, include_mtp, fp8_layout, conv_dtype)["bytes"]


def cache_bytes(cfg: LingConfig, cache_dtype_bytes: int = 2, state_dtype_bytes: int = 4,
                conv_dtype_bytes: int = 2, kv_cache_dtype: str = "auto") -> dict:
    """Inference cache sizes (spec §14), BF16 MLA cache / FP32 KDA state / BF16 conv state by default.

    * MLA (absorbed) latent cache: (kv_lora_rank + qk_rope_head_dim) values per token per MLA layer;
      ``mla_bytes_per_token`` counts the main MLA layers, ``..._with_mtp`` adds the MTP layer's.
      kv_cache_dtype "fp8" (`ling_jax.kv_quant`): 1 byte per value + two float32 per-token scales
      (584 B per token per layer for the real config, vs 1,152 in BF16); "auto"/"bf16": cache_dtype_bytes.
    * MLA expanded (reference) cache, for comparison: H·(qk_head_dim + v_head_dim) per token/layer.
    * KDA recurrent state: [H, head_dim, head_dim] per KDA layer per sequence, length-independent.
    * KDA conv state: 3 streams (q, k, v) × kda_width × (kernel − 1) past inputs per KDA layer.
    """
    types = cfg.layer_types
    n_mla = sum(1 for t in types if t == MLA)
    n_kda = sum(1 for t in types if t == KDA)
    n_mtp = 1 if cfg.has_mtp else 0
    if kv_cache_dtype not in ("auto", "bf16", "fp8"):
        raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r} (expected bf16 or fp8)")
    if kv_cache_dtype == "fp8":
        mla_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim + 2 * 4
    else:
        mla_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cache_dtype_bytes
    expanded_layer = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * cache_dtype_bytes
    kda_layer = cfg.num_attention_heads * cfg.head_dim * cfg.head_dim * state_dtype_bytes
    conv_layer = 3 * cfg.kda_width * max(cfg.short_conv_kernel_size - 1, 0) * conv_dtype_bytes
    return {
        "num_mla_layers": n_mla,
        "num_kda_layers": n_kda,
        "num_mtp_mla_layers": n_mtp,
        "mla_bytes_per_token_per_layer": mla_layer,
        "mla_bytes_per_token": n_mla * mla_layer,
        "mla_bytes_per_token_mtp_layer": n_mtp * mla_layer,
        "mla_bytes_per_token_with_mtp": (n_mla + n_mtp) * mla_layer,
        "mla_expanded_bytes_per_token": n_mla * expanded_layer,
        "kda_state_bytes_per_sequence_per_layer": kda_layer,
        "kda_state_bytes_per_sequence": n_kda * kda_layer,
        "kda_conv_state_bytes_per_sequence_per_layer": conv_layer,
        "kda_conv_state_bytes_per_sequence": n_kda * conv_layer,
        "cache_dtype_bytes": cache_dtype_bytes,
        "state_dtype_bytes": state_dtype_bytes,
        "conv_dtype_bytes": conv_dtype_bytes,
    }


# ---------------------------------------------------------------------------------------------
# meshes and memory plans
# ---------------------------------------------------------------------------------------------
def _split(pspec, mesh: dict[str, int]) -> int:
    """Number of devices one copy of an array with `pspec` is spread over on `mesh`."""
    return math.prod(mesh.get(a, 1) for a in pspec if a is not None)


def _weight_name(t: Stored) -> str:
    """The matrix a stored tensor belongs to (itself, or the weight of a scale tensor)."""
    if not t.scale:
        return t.name
    for suf in SCALE_SUFFIXES:
        if t.name.endswith(suf):
            return t.name[: -len(suf)] + ".weight"
    return t.name


def per_device_weight_bytes(cfg: LingConfig, tensors: Iterable[Stored], mesh: dict[str, int]) -> dict:
    """Weight bytes of the stored `tensors` on one device of `mesh`, placed exactly as the loader
    places them: each tensor's parameter declares logical axes (`ling_jax.loader.param_layout`),
    `sharding.rules.spec` maps them to mesh axes with the divisibility fallback (a dimension that
    does not divide is replicated), and block scales follow `block_fp8_specs` (dense-matrix scales
    replicated, routed-expert scales split with their experts; MXFP4 scales, one per 32 inputs, split
    like their weight wherever their grid divides). Every device of a full mesh holds the same amount.
    Returns {"routed", "other", "total"}; "routed" = the routed experts (main and MTP) with their scales.
    """
    layout = param_layout(cfg)
    heads = cfg.num_attention_heads
    specs: dict = {}
    nbytes: dict = {}  # (key, routed?) -> stored bytes: summed as integers, divided once per key
    for t in tensors:
        name = _weight_name(t)
        if name not in layout:
            raise ValueError(f"{t.name}: no model parameter holds this tensor (not part of the model of this config)")
        path, axes, shape = layout[name]
        mx = ".mlp.experts." in t.name and t.dtype in MXFP4_DTYPES
        key = (path, t.scale, mx)
        if key not in specs:
            where = "/".join(map(str, path))
            if mx:  # MXFP4 codes and scales: one spec, decided on the 32-group grid (`placement.mxfp4_spec`)
                vs = mxfp4_spec(axes, shape, mesh, heads, where=where)
            else:
                vs = spec(axes, shape, mesh, heads, where=where)
                if t.scale:
                    vs = block_fp8_specs(vs, fp8_block(path, cfg), len(shape))
            specs[key] = _split(vs, mesh)
        group = (key, ".mlp.experts." in t.name)
        nbytes[group] = nbytes.get(group, 0) + t.nbytes
    per_device = {True: Fraction(0), False: Fraction(0)}  # routed?, exact
    for (key, is_routed), n in nbytes.items():
        per_device[is_routed] += Fraction(n, specs[key])
    r, o = math.ceil(per_device[True]), math.ceil(per_device[False])
    return {"routed": r, "other": o, "total": r + o}


_RESIDENT: dict = {}


def _resident_model(cfg: LingConfig, fmt: str, include_mtp: bool, fp8_layout: Optional[str], dtype: str):
    """The shape-only model the loader builds for a `fmt` checkpoint loaded with keep_quantized (fp8:
    FP8 matrices as BlockFP8; mxfp4: also the routed experts as MXFP4Blocks; bf16: floats) in `dtype`.
    Memoized (the last one: ~3 s for the real config)."""
    key = (json.dumps(cfg.to_dict(), sort_keys=True, default=str), fmt, include_mtp, fp8_layout, dtype)
    if key not in _RESIDENT:
        f8 = release_fp8(cfg, fp8_layout or L.DEFAULT_FP8_LAYOUT) if fmt != "bf16" else None
        mx = release_mxfp4(cfg) if fmt == "mxfp4" else None
        _RESIDENT.clear()
        _RESIDENT[key] = abstract_model(cfg, dtype, include_mtp and cfg.has_mtp, f8, mx)
    return _RESIDENT[key]


def resident_bytes_per_device(cfg: LingConfig, fmt: str, mesh: dict[str, int], include_mtp: bool = True,
                              fp8_layout: Optional[str] = RELEASE_FP8_LAYOUT, dtype: str = "bfloat16") -> int:
    """Bytes of the device arrays ONE device holds after `load_model(..., keep_quantized=True)` of a
    `fmt` checkpoint in `dtype` on `mesh`: the loader's own shape-only model (`loader.abstract_model`)
    placed by its own specs (`placement.param_specs`), constants (SwiGLU limits) included.

    It differs from the stored-bytes placement (`per_device_weight_bytes`) where the model does not
    hold a tensor as stored: router weights are float32 (stored BF16; routing runs in float32: +0.27
    GiB per device for the real config, nearly all of the difference for MXFP4), kept-FP8 routed-expert
    scales are expanded per element along I (`quantized.BlockFP8`; fp8 only), F32-stored conv taps
    take `dtype` (-3 MB per device on model=4), and the per-layer SwiGLU limits are 4-byte arrays."""
    model = _resident_model(cfg, fmt, include_mtp, fp8_layout, dtype)
    specs = param_specs(model, mesh, cfg.num_attention_heads)
    total = 0
    for p, v in nnx.to_flat_state(nnx.state(model)):
        val, sp = v.get_value(), specs[tuple(p)]
        leaves = [val.primary, val.scales] if is_quantized(val) else [val]
        sps = [sp.primary, sp.scales] if is_quantized(sp) else [sp]
        for a, s in zip(leaves, sps):
            n = math.prod(a.shape) * a.dtype.itemsize
            total += n // _split(s, mesh)
    return total


def plan(cfg: LingConfig, fmt: str = "fp8", mesh: Optional[dict] = None,
         device_memory_gib: Optional[float] = None, include_mtp: bool = True,
         reserve_gib: float = 0.0, sequences: int = 1,
         fp8_layout: Optional[str] = RELEASE_FP8_LAYOUT, conv_dtype: str = RELEASE_CONV_DTYPE,
         kv_cache_dtype: str = "bf16") -> dict:
    """Weight and cache memory of serving `cfg` on `mesh` (see `ling-jax plan --help`)."""
    _check_format(fmt)
    _check_layout(fp8_layout)
    mesh = dict(mesh or parse_mesh_shape(None))
    if device_memory_gib is not None and not (isinstance(device_memory_gib, (int, float))
                                              and math.isfinite(device_memory_gib) and device_memory_gib > 0):
        raise ValueError(f"device memory must be a positive number of GiB, got {device_memory_gib!r}")
    if not (math.isfinite(reserve_gib) and reserve_gib >= 0):
        raise ValueError(f"reserve must be a non-negative number of GiB, got {reserve_gib!r}")
    check_int(sequences, "sequences", low=0, expected="a non-negative integer")
    summ = summary(cfg, fmt, include_mtp, fp8_layout, conv_dtype)
    dev = per_device_weight_bytes(cfg, stored_tensors(cfg, fmt, include_mtp, fp8_layout, conv_dtype), mesh)
    cache = cache_bytes(cfg, kv_cache_dtype=kv_cache_dtype)
    use_mtp = include_mtp and cfg.has_mtp
    mla_tok = cache["mla_bytes_per_token_with_mtp"] if use_mtp else cache["mla_bytes_per_token"]
    # KDA state and conv buffers split by head over `model` by the cache rules (when the head count
    # divides); the MLA latent has a single KV head, so every device of a model replica keeps all of it.
    H, d, K = cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
    one = {**mesh, "data": 1}  # per sequence: the batch split over `data` is not part of it
    state_split = _split(spec(cache_axes("cache/layers/0/recurrent"), (1, H, d, d), one, H), one)
    conv_split = _split(spec(cache_axes("cache/layers/0/conv_q"), (1, max(K - 1, 1), H * d), one, H), one)
    kda_dev = -(-cache["kda_state_bytes_per_sequence"] // state_split)
    conv_dev = -(-cache["kda_conv_state_bytes_per_sequence"] // conv_split)
    n_dev = mesh["data"] * mesh["expert"] * mesh["model"]
    # the seed article's arithmetic: every byte (weights and KDA state) split evenly over the devices
    even = -(-summ["bytes"]["total"] // n_dev)
    even_state = -(-(cache["kda_state_bytes_per_sequence"] + cache["kda_conv_state_bytes_per_sequence"]) // n_dev)
    resident = resident_bytes_per_device(cfg, fmt, mesh, include_mtp, fp8_layout)
    out = {
        "weights": fmt,
        "fp8_layout": fp8_layout if fmt != "bf16" else None,
        "conv_dtype": conv_dtype if fmt != "bf16" else "BF16",
        "include_mtp": use_mtp,
        "params": summ["params"]["total"],
        "weight_bytes": summ["bytes"]["total"],
        "weight_gib": round(summ["bytes"]["total"] / GiB, 2),
        "weight_bytes_by_group": {k: v for k, v in summ["bytes"].items() if k != "total"},
        "mesh": mesh,
        "devices": mesh["data"] * mesh["expert"] * mesh["model"],
        "weight_bytes_per_device": dev["total"],
        "weight_gib_per_device": round(dev["total"] / GiB, 2),
        "routed_expert_bytes_per_device": dev["routed"],
        "even_split_bytes_per_device": even,
        "even_split_gib_per_device": round(even / GiB, 2),
        "resident_bytes_per_device": resident,
        "resident_gib_per_device": round(resident / GiB, 2),
        "kv_cache_dtype": kv_cache_dtype,
        "mla_cache_bytes_per_token": mla_tok,
        "mla_cache_bytes_per_token_main": cache["mla_bytes_per_token"],
        "mla_cache_bytes_per_token_mtp": cache["mla_bytes_per_token_mtp_layer"] if use_mtp else 0,
        "kda_state_bytes_per_sequence": cache["kda_state_bytes_per_sequence"],
        "kda_conv_state_bytes_per_sequence": cache["kda_conv_state_bytes_per_sequence"],
        "kda_state_bytes_per_sequence_per_device": kda_dev,
        "kda_conv_state_bytes_per_sequence_per_device": conv_dev,
        "sequences": sequences,
        "device_memory_bytes": None,
        "reserve_bytes": int(round(reserve_gib * GiB)),
        "free_bytes_per_device": None,
        "tokens_fit": None,
        "tokens_fit_mesh": None,
        "fits": None,
        "even_split_free_bytes_per_device": None,
        "even_split_tokens_fit": None,
    }
    if device_memory_gib is not None:
        mem = int(round(device_memory_gib * GiB))
        free = mem - dev["total"] - out["reserve_bytes"]
        cache_free = free - sequences * (kda_dev + conv_dev)
        tokens = max(cache_free, 0) // mla_tok if mla_tok else None
        out.update({"device_memory_bytes": mem, "free_bytes_per_device": free,
                    "tokens_fit": tokens if cache_free >= 0 else 0,
                    "tokens_fit_mesh": (tokens if cache_free >= 0 else 0) * mesh["data"]
                    if tokens is not None else None,
                    "fits": cache_free >= 0})
        even_free = mem - even - out["reserve_bytes"]
        even_cache = even_free - sequences * even_state
        out.update({"even_split_free_bytes_per_device": even_free,
                    "even_split_tokens_fit": max(even_cache, 0) // mla_tok if mla_tok else None})
    return out


def fmt_bytes(n: Optional[int]) -> str:
    """Human-readable binary size: `534.35 GiB`."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,} B"
