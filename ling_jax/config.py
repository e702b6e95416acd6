"""Model configuration: one frozen dataclass parsed from a `bailing_hybrid` config.json.

Every structural value the forward pass reads lives here, validated once, so the modules never
look at raw JSON. Field names follow the Hugging Face config (spec §2); derived per-layer
schedules (layer type, FFN type, SwiGLU limits) are computed here by the reference rules (§3).

Required fields and defaults. A field that fixes a tensor shape or the layer schedule has no
reference default: if config.json lacks it, parsing fails naming it (a silent default would turn a
missing `hidden_size` into a thousand shape errors). Every other field has the reference (family)
value of spec §2 as its default:

    required (no default)           vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
                                    head_dim, intermediate_size, layer_group_size,
                                    first_k_dense_replace, q_lora_rank (may be null), kv_lora_rank,
                                    qk_nope_head_dim, qk_rope_head_dim, v_head_dim, num_experts
                                    (or num_local_experts), num_experts_per_tok,
                                    moe_intermediate_size, moe_shared_expert_intermediate_size
    reference default               num_key_value_heads (= num_attention_heads), rms_norm_eps 1e-6,
                                    tie_word_embeddings false, pad_token_id 156892,
                                    eos_token_id 156895, bos_token_id none,
                                    num_nextn_predict_layers 1, short_conv_kernel_size 4,
                                    kda_lower_bound -5, rope_theta 6e6, rope_scaling none,
                                    max_position_embeddings 262144, num_shared_experts 1, n_group 8,
                                    topk_group 4, routed_scaling_factor 2.5, norm_topk_prob true,
                                    SwiGLU limit lists empty (no clamp), mtp_loss_scaling_factor 0,
                                    quantization_config none (unquantised)

Every value present is type- and range-checked (finite positive eps and scaling factor, finite
non-negative SwiGLU limits, integer token ids inside the vocabulary, a bounded
max_position_embeddings, rope_scaling an object, quantization_config an object, ...). Parsing costs
O(size of the JSON): nothing loops over a claimed count (experts, layers) here; the checkpoint
reader bounds such counts by what the files hold before it enumerates tensors.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from typing import Any, Optional

from ling_jax.checks import is_int

MLA = "mla"
KDA = "kda"


class ConfigError(ValueError):
    """A config.json value that is missing, unknown or contradictory."""


#: A config.json is a few kB; refuse anything far larger before parsing it.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
#: Positions are int32 in the caches and rotary tables.
MAX_POSITIONS = 2**31 - 1


def parse_json_bytes(raw: bytes, src: str, error=None):
    """JSON of a file's UTF-8 bytes, or `error` (default ConfigError) naming `src`: every JSON file we
    read goes through here. NaN/Infinity literals (which Python writes) parse, so that the field
    check names the field that holds one."""
    error = error or ConfigError
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{src}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise error(f"{src}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError and the NaN/Infinity refusal
        raise error(f"{src}: not valid JSON ({e})") from None


def read_json_file(path: str, error=None, limit: int = MAX_CONFIG_BYTES):
    """JSON of the file at `path`, at most `limit` bytes (the JSON files of a checkpoint are small), or
    `error` (default ConfigError) naming it: missing, a directory, unreadable, too large, not JSON."""
    error = error or ConfigError
    too_big = error(f"{path}: larger than {limit} bytes (not a {os.path.basename(path)} we can use)")
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())  # size first: `f.read(n)` allocates n bytes up front
            if st.st_size > limit:
                raise too_big
            raw = f.read() if stat.S_ISREG(st.st_mode) else f.read(limit + 1)  # a pipe reports no size
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) > limit:
        raise too_big
    return parse_json_bytes(raw, path, error)


def write_json(path: str, obj) -> None:
    """`obj` as an indented JSON file (what we write beside a checkpoint: config, index, tokenizer config)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# Fields that fix tensor shapes or the schedule: no reference default (see the module docstring).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                   "intermediate_size", "layer_group_size", "first_k_dense_replace", "q_lora_rank",
                   "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
                   "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size")
_ALIASES = {"num_experts": "num_local_experts", "num_nextn_predict_layers": "num_mtp_layers",
            "num_shared_experts": "n_shared_experts"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (spec §10.3); values pinned explicitly, no library-version defaults."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class LingConfig:
    vocab_size: int = 157184
    hidden_size: int = 4096
    num_hidden_layers: int = 72
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    head_dim: int = 128
    intermediate_size: int = 10240
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    pad_token_id: Optional[int] = 156892
    eos_token_id: tuple[int, ...] = (156895,)
    bos_token_id: Optional[int] = None
    # schedule
    layer_group_size: int = 8
    first_k_dense_replace: int = 4
    num_nextn_predict_layers: int = 1
    # KDA
    short_conv_kernel_size: int = 4
    kda_lower_bound: float = -5.0
    # MLA
    q_lora_rank: Optional[int] = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 6_000_000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 262144
    # MoE
    num_experts: int = 512
    num_experts_per_tok: int = 8
    num_shared_experts: int = 1
    moe_intermediate_size: int = 1280
    moe_shared_expert_intermediate_size: int = 1280
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    expert_swiglu_limit_list: tuple[float, ...] = ()
    share_expert_swiglu_limit_list: tuple[float, ...] = ()
    #: Our switch (not in HF configs): apply the late-layer SwiGLU clamp (spec §7.2).
    apply_swiglu_clamp: bool = True
    mtp_loss_scaling_factor: float = 0.0
    # FP8 release format
    quantization_config: Optional[dict] = dataclasses.field(default=None, hash=False)  # dict: not hashable

    # ---- derived --------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_width(self) -> int:
        """Width of the KDA q/k/v/f/g projections: heads × head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def layer_types(self) -> tuple[str, ...]:
        """MLA iff (i+1) % group == 0, or i lies in an incomplete trailing group (spec §3)."""
        g, n = self.layer_group_size, self.num_hidden_layers
        full = (n // g) * g
        return tuple(MLA if ((i + 1) % g == 0 or i >= full) else KDA for i in range(n))

    def is_moe(self, layer: int) -> bool:
        """Layers before first_k_dense_replace are dense; the rest (and the MTP layer) are MoE."""
        return layer >= self.first_k_dense_replace

    def swiglu_limits(self, layer: int) -> tuple[float, float]:
        """(routed, shared) SwiGLU clamp limits; 0.0 means no clamp. MTP layer is unclamped."""
        if not self.apply_swiglu_clamp or layer >= self.num_hidden_layers:
            return 0.0, 0.0
        r = self.expert_swiglu_limit_list[layer] if self.expert_swiglu_limit_list else 0.0
        s = self.share_expert_swiglu_limit_list[layer] if self.share_expert_swiglu_limit_list else 0.0
        return float(r or 0.0), float(s or 0.0)

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def routed_experts_mxfp4(self) -> bool:
        """quantization_config declares MXFP4 routed experts (`routed_experts_quant_method: mxfp4`,
        Ling's recipe; `ling_jax.checkpoint.mxfp4`)."""
        return (self.quantization_config or {}).get("routed_experts_quant_method") == "mxfp4"

    @property
    def weight_block_size(self) -> tuple[int, int]:
        q = self.quantization_config or {}
        return tuple(q.get("weight_block_size", (128, 128)))

    # ---- parsing --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "LingConfig":
        return _parse(d, source)

    @classmethod
    def from_json(cls, path: str) -> "LingConfig":
        p = os.path.join(path, "config.json") if os.path.isdir(path) else path
        return _parse(read_json_file(p), p)

    def to_dict(self) -> dict[str, Any]:
        """The HF-style config.json fields (what the checkpoint writer stores)."""
        d = dataclasses.asdict(self)
        d.pop("apply_swiglu_clamp")
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        d["rope_scaling"] = None if self.rope_scaling is None else {
            "rope_type": "yarn", **{k: v for k, v in dataclasses.asdict(self.rope_scaling).items() if v is not None}}
        d["expert_swiglu_limit_list"] = list(self.expert_swiglu_limit_list)
        d["share_expert_swiglu_limit_list"] = list(self.share_expert_swiglu_limit_list)
        if d["quantization_config"] is None:
            d.pop("quantization_config")
        out = {"architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid", "dtype": "bfloat16"}
        out.update(d)
        out.update({k: allowed[0] for k, allowed in _REQUIRED_VALUES.items()})  # the reference's fixed choices
        out.update({"qk_head_dim": self.qk_head_dim, "router_dtype": "fp32"})
        return out

    def replace(self, **kw) -> "LingConfig":
        """A modified copy, re-validated (used for `--layers/--experts` overrides)."""
        d = self.to_dict()
        d.update(kw)
        return _parse(d, "override")


# Fields whose value we accept only as the reference's; anything else is a different model.
_REQUIRED_VALUES = {
    "model_type": ("bailing_hybrid", "bailing_moe_v3"), "hidden_act": ("silu",), "no_kda_lora": (True,),
    "use_kda_lora": (False,), "rope_interleave": (True,), "use_mla_nope": (False,),
    "gated_attention_proj_granularity_type": ("head_wise",), "mtp_use_kda": (False,), "score_function": ("sigmoid",),
    "scoring_func": ("sigmoid",), "use_bias": (False,), "use_qkv_bias": (False,),
    "moe_router_enable_expert_bias": (True,), "tie_word_embeddings": (False,), "topk_method": ("noaux_tc",),
    "kda_safe_gate": (True,),
}


#: The plain int / float / bool fields, by their annotation (each type- and range-checked in `_parse`).
_INT_FIELDS, _FLOAT_FIELDS, _BOOL_FIELDS = (tuple(f.name for f in dataclasses.fields(LingConfig) if f.type == t)
                                            for t in ("int", "float", "bool"))
_INT_LIMIT = 2**31  # every size and id is an int32 somewhere (shapes, positions, token ids)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v) -> bool:
    """A finite number that fits a float (a 400-digit JSON integer does not)."""
    if not _is_number(v):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _parse(d: dict[str, Any], src: str) -> LingConfig:
    def err(msg):
        raise ConfigError(f"{src}: {msg}")

    if not isinstance(d, dict):
        err(f"is not a JSON object (got {type(d).__name__}: {str(d)[:40]!r}); expected a bailing_hybrid config")
    for k, allowed in _REQUIRED_VALUES.items():
        if k in d and d[k] is not None and not any(d[k] == a and type(d[k]) is type(a) for a in allowed):
            err(f"{k}={d[k]!r} is not supported (expected {' or '.join(map(repr, allowed))})")
    for name in REQUIRED_FIELDS:
        alias = _ALIASES.get(name)
        present = name in d or (alias is not None and alias in d)
        if not present or (name != "q_lora_rank" and d.get(name, d.get(alias)) is None):
            err(f"has no {name} (required: it fixes tensor shapes or the layer schedule and has no "
                f"reference default)")
    kw: dict[str, Any] = {f.name: d[f.name] for f in dataclasses.fields(LingConfig) if d.get(f.name) is not None}
    for name, alias in _ALIASES.items():
        if alias in d and name not in d and d[alias] is not None:
            kw[name] = d[alias]
    # the pad id may legitimately be null
    if "pad_token_id" in d:
        kw["pad_token_id"] = d["pad_token_id"]

    for k in _INT_FIELDS:
        if k in kw:
            v = kw[k]
            if not is_int(v) or not 0 <= v < _INT_LIMIT:
                err(f"{k} must be a non-negative integer below 2^31, got {v!r}")
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    for k in _FLOAT_FIELDS:
        if k in kw:
            if not _finite(kw[k]):
                err(f"{k} must be a finite number, got {kw[k]!r}")
            kw[k] = float(kw[k])
    for k in _BOOL_FIELDS:
        if k in kw and not isinstance(kw[k], bool):
            err(f"{k} must be true or false, got {kw[k]!r}")
    if kw.get("q_lora_rank") is not None and (not is_int(kw["q_lora_rank"]) or not 0 < kw["q_lora_rank"] < _INT_LIMIT):
        err(f"q_lora_rank must be a positive integer or null, got {kw['q_lora_rank']!r}")
    if "q_lora_rank" not in kw and "q_lora_rank" in d:
        kw["q_lora_rank"] = None
    _parse_token_ids(d, kw, err)
    _parse_rope(d, kw, err)
    q = d.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        err(f"quantization_config must be an object or null, got {type(q).__name__} {str(q)[:40]!r}")

    n = kw["num_hidden_layers"]
    for k in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        v = d.get(k)
        if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):  # absent or [] = no clamp
            kw[k] = ()
            continue
        if not isinstance(v, (list, tuple)) or len(v) != n:
            err(f"{k} must be a list of num_hidden_layers={n} numbers, got "
                f"{'length ' + str(len(v)) if isinstance(v, (list, tuple)) else type(v).__name__}")
        for j, x in enumerate(v):
            if x is not None and not _finite(x):
                err(f"{k}[{j}] must be a finite number (or null/0 for no clamp), got {x!r}")
        kw[k] = tuple(float(x or 0.0) for x in v)
        if any(x < 0 for x in kw[k]):
            err(f"{k}[{next(j for j, x in enumerate(kw[k]) if x < 0)}] is a negative limit")
    cfg = LingConfig(**kw)
    _validate(cfg, err, d)
    return cfg


def _parse_token_ids(d: dict, kw: dict, err) -> None:
    """eos (int or non-empty list), pad and bos (int or null): integers inside the vocabulary when
    given; absent ones keep the reference default (spec §2.1)."""
    V = kw["vocab_size"]

    def check(field, v):
        if not is_int(v):
            err(f"{field} must be an integer token id, got {v!r}")
        if not 0 <= v < V:
            err(f"{field}={v} is outside the vocabulary [0, vocab_size={V})")

    if "eos_token_id" in kw:
        eos = kw["eos_token_id"]
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if not eos:
            err("eos_token_id is an empty list (give one id, a list of ids, or leave it out)")
        for i, v in enumerate(eos):
            check("eos_token_id" + (f"[{i}]" if len(eos) > 1 else ""), v)
        kw["eos_token_id"] = tuple(eos)
    for field in ("pad_token_id", "bos_token_id"):
        if kw.get(field) is not None:
            check(field, kw[field])


def _number(rs: dict, key: str, err, default=None, positive: bool = False):
    v = rs.get(key)
    if v is None:
        return default
    if not _finite(v) or (positive and v <= 0):
        err(f"rope_scaling.{key} must be a finite {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def _parse_rope(d: dict, kw: dict, err) -> None:
    """rope_scaling / rope_parameters: null, {"rope_type": "default"} or a YaRN object (spec §10.3)."""
    key = "rope_scaling" if d.get("rope_scaling") is not None else "rope_parameters"
    rs = d.get(key)
    kw["rope_scaling"] = None
    if rs is None:
        return
    if not isinstance(rs, dict):
        err(f"{key} must be an object or null, got {type(rs).__name__} {str(rs)[:40]!r}")
    if "rope_theta" in rs and "rope_theta" not in d:
        v = rs["rope_theta"]
        if not _finite(v):
            err(f"{key}.rope_theta must be a finite number, got {v!r}")
        kw["rope_theta"] = float(v)
    rt = rs.get("rope_type", rs.get("type", "default"))
    if rt in ("default", None):
        return
    if rt != "yarn":
        err(f"{key}.rope_type={rt!r} is not supported (expected 'yarn' or 'default')")
    if "factor" not in rs:
        err(f"{key} of type yarn needs 'factor'")
    omp = rs.get("original_max_position_embeddings") or kw.get("max_position_embeddings", 262144)
    if not is_int(omp) or not 0 < omp < _INT_LIMIT:
        err(f"{key}.original_max_position_embeddings must be a positive integer, got {omp!r}")
    trunc = rs.get("truncate", True)
    if not isinstance(trunc, bool):
        err(f"{key}.truncate must be true or false, got {trunc!r}")
    kw["rope_scaling"] = RopeScaling(
        factor=_number(rs, "factor", err, positive=True), original_max_position_embeddings=omp,
        beta_fast=_number(rs, "beta_fast", err, 32.0) or 32.0, beta_slow=_number(rs, "beta_slow", err, 1.0) or 1.0,
        mscale=_number(rs, "mscale", err), mscale_all_dim=_number(rs, "mscale_all_dim", err),
        attention_factor=_number(rs, "attention_factor", err, positive=True), truncate=trunc)


def _validate(c: LingConfig, err, d: dict) -> None:
    if c.hidden_size <= 0 or c.num_hidden_layers <= 0 or c.vocab_size <= 0:
        err("hidden_size, num_hidden_layers and vocab_size must be positive")
    if c.num_attention_heads <= 0 or c.head_dim <= 0:
        err("num_attention_heads and head_dim must be positive")
    if c.num_key_value_heads != c.num_attention_heads:
        err(f"num_key_value_heads={c.num_key_value_heads} must equal num_attention_heads="
            f"{c.num_attention_heads} (MLA has no grouped-query attention)")
    qk = d.get("qk_head_dim")
    if qk is not None and qk != c.qk_head_dim:
        err(f"qk_head_dim={qk} contradicts qk_nope_head_dim + qk_rope_head_dim = {c.qk_head_dim}")
    if c.qk_rope_head_dim % 2:
        err(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even (interleaved rotary pairs)")
    if c.layer_group_size <= 0:
        err("layer_group_size must be positive")
    if c.first_k_dense_replace > c.num_hidden_layers:
        err(f"first_k_dense_replace={c.first_k_dense_replace} exceeds num_hidden_layers={c.num_hidden_layers}")
    if c.num_nextn_predict_layers > 1:
        err(f"num_nextn_predict_layers={c.num_nextn_predict_layers}: only 0 or 1 MTP layer is supported")
    if c.short_conv_kernel_size < 1:
        err("short_conv_kernel_size must be >= 1")
    if not c.kda_lower_bound < 0:
        err(f"kda_lower_bound={c.kda_lower_bound} must be negative (log-decay lower bound)")
    if not c.rms_norm_eps > 0:
        err(f"rms_norm_eps={c.rms_norm_eps} must be a positive number (it keeps RMSNorm away from 1/0)")
    if not c.routed_scaling_factor > 0:
        err(f"routed_scaling_factor={c.routed_scaling_factor} must be positive")
    if c.mtp_loss_scaling_factor < 0:
        err(f"mtp_loss_scaling_factor={c.mtp_loss_scaling_factor} must be >= 0")
    if not 0 < c.max_position_embeddings <= MAX_POSITIONS:
        err(f"max_position_embeddings={c.max_position_embeddings} must be in 1..{MAX_POSITIONS} "
            f"(positions are int32)")
    if c.num_experts > 0 or c.first_k_dense_replace < c.num_hidden_layers or c.has_mtp:
        if c.num_experts <= 0:
            err("num_experts must be positive when any layer is MoE")
        if c.n_group <= 0 or c.num_experts % c.n_group:
            err(f"n_group={c.n_group} must divide num_experts={c.num_experts}")
        if not 0 < c.topk_group <= c.n_group:
            err(f"topk_group={c.topk_group} must be in 1..n_group={c.n_group}")
        per_group = c.num_experts // c.n_group
        if per_group < 2:
            err(f"each expert group needs >= 2 experts (group score = sum of top-2), got {per_group}")
        if not 0 < c.num_experts_per_tok <= c.topk_group * per_group:
            err(f"num_experts_per_tok={c.num_experts_per_tok} must be in 1..topk_group*experts_per_group="
                f"{c.topk_group * per_group}")
    q = c.quantization_config
    if q is not None:
        if q.get("quant_method") not in ("fp8",):
            err(f"quantization_config.quant_method={q.get('quant_method')!r} is not supported (expected 'fp8')")
        if q.get("fmt", "e4m3") != "e4m3":
            err(f"quantization_config.fmt={q.get('fmt')!r} is not supported (expected 'e4m3')")
        bs = q.get("weight_block_size", [128, 128])
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(is_int(x) and 0 < x < _INT_LIMIT for x in bs)):
            err(f"quantization_config.weight_block_size={bs!r} must be two positive integers")
        rq = q.get("routed_experts_quant_method")
        if rq is not None and rq != "mxfp4":
            err(f"quantization_config.routed_experts_quant_method={rq!r} is not supported (expected 'mxfp4')")
        gs = q.get("routed_experts_group_size", 32)
        if rq is not None and (not is_int(gs) or gs != 32):
            err(f"quantization_config.routed_experts_group_size={gs!r} is not supported (MXFP4 routed experts "
                f"use groups of 32)")
        mnc = q.get("modules_to_not_convert")
        if mnc is not None and not (isinstance(mnc, list) and all(isinstance(x, str) for x in mnc)):
            err("quantization_config.modules_to_not_convert must be a list of module names")
    if c.rope_theta <= 1:
        err(f"rope_theta={c.rope_theta} must be > 1")
