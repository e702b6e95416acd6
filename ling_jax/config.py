"""Model configuration: one frozen dataclass parsed from a `bailing_hybrid` config.json.

Every structural value the forward pass reads lives here, validated once, so the modules never
look at raw JSON. Field names follow the Hugging Face config (spec §2); derived per-layer
schedules (layer type, FFN type, SwiGLU limits) are computed here by the reference rules (§3).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

MLA = "mla"
KDA = "kda"


class ConfigError(ValueError):
    """A config.json value that is missing, unknown or contradictory."""


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
        try:
            with open(p) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{p}: config file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        return _parse(d, p)

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
        out.update({"qk_head_dim": self.qk_head_dim, "no_kda_lora": True, "use_kda_lora": False,
                    "kda_safe_gate": True, "rope_interleave": True, "use_mla_nope": False,
                    "gated_attention_proj_granularity_type": "head_wise", "mtp_use_kda": False,
                    "score_function": "sigmoid", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                    "moe_router_enable_expert_bias": True, "hidden_act": "silu", "use_bias": False,
                    "use_qkv_bias": False, "router_dtype": "fp32"})
        return out

    def replace(self, **kw) -> "LingConfig":
        """A modified copy, re-validated (used for `--layers/--experts` overrides)."""
        d = self.to_dict()
        d.update(kw)
        return _parse(d, "override")


# Fields whose value we accept only as the reference's; anything else is a different model.
_REQUIRED_VALUES = {
    "model_type": ("bailing_hybrid", "bailing_moe_v3"),
    "hidden_act": ("silu",),
    "no_kda_lora": (True,),
    "use_kda_lora": (False,),
    "rope_interleave": (True,),
    "use_mla_nope": (False,),
    "gated_attention_proj_granularity_type": ("head_wise",),
    "mtp_use_kda": (False,),
    "score_function": ("sigmoid",),
    "scoring_func": ("sigmoid",),
    "use_bias": (False,),
    "use_qkv_bias": (False,),
    "moe_router_enable_expert_bias": (True,),
    "tie_word_embeddings": (False,),
    "topk_method": ("noaux_tc",),
    "kda_safe_gate": (True,),
}


def _parse(d: dict[str, Any], src: str) -> LingConfig:
    def err(msg):
        raise ConfigError(f"{src}: {msg}")

    for k, allowed in _REQUIRED_VALUES.items():
        if k in d and d[k] is not None and d[k] not in allowed:
            err(f"{k}={d[k]!r} is not supported (expected {' or '.join(map(repr, allowed))})")
    kw: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(LingConfig)}
    for name in fields:
        if name in d and d[name] is not None:
            kw[name] = d[name]
    if "num_mtp_layers" in d and "num_nextn_predict_layers" not in d:
        kw["num_nextn_predict_layers"] = d["num_mtp_layers"]
    if "num_local_experts" in d and "num_experts" not in d:
        kw["num_experts"] = d["num_local_experts"]
    if "n_shared_experts" in d and "num_shared_experts" not in d:
        kw["num_shared_experts"] = d["n_shared_experts"]
    # the pad id may legitimately be null
    if "pad_token_id" in d:
        kw["pad_token_id"] = d["pad_token_id"]

    ints = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "layer_group_size", "first_k_dense_replace",
            "num_nextn_predict_layers", "short_conv_kernel_size", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "num_experts", "num_experts_per_tok",
            "num_shared_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_group",
            "topk_group"]
    for k in ints:
        if k in kw:
            v = kw[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                err(f"{k} must be a non-negative integer, got {v!r}")
    for k in ["rms_norm_eps", "kda_lower_bound", "rope_theta", "routed_scaling_factor", "mtp_loss_scaling_factor"]:
        if k in kw:
            if isinstance(kw[k], bool) or not isinstance(kw[k], (int, float)):
                err(f"{k} must be a number, got {kw[k]!r}")
            kw[k] = float(kw[k])
    if kw.get("q_lora_rank") is not None and (not isinstance(kw["q_lora_rank"], int) or kw["q_lora_rank"] <= 0):
        err(f"q_lora_rank must be a positive integer or null, got {kw['q_lora_rank']!r}")
    if "q_lora_rank" not in kw and "q_lora_rank" in d:
        kw["q_lora_rank"] = None
    eos = kw.get("eos_token_id", (156895,))
    kw["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)

    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type", "default")) not in ("default", None):
        rt = rs.get("rope_type", rs.get("type"))
        if rt != "yarn":
            err(f"rope_scaling.rope_type={rt!r} is not supported (expected 'yarn' or 'default')")
        if "factor" not in rs:
            err("rope_scaling of type yarn needs 'factor'")
        kw["rope_scaling"] = RopeScaling(
            factor=float(rs["factor"]),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings")
                                                  or d.get("max_position_embeddings", 262144)),
            beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
            mscale=None if rs.get("mscale") is None else float(rs["mscale"]),
            mscale_all_dim=None if rs.get("mscale_all_dim") is None else float(rs["mscale_all_dim"]),
            attention_factor=None if rs.get("attention_factor") is None else float(rs["attention_factor"]),
            truncate=bool(rs.get("truncate", True)))
        if isinstance(rs, dict) and "rope_theta" in rs and "rope_theta" not in d:
            kw["rope_theta"] = float(rs["rope_theta"])
    else:
        kw["rope_scaling"] = None
        if isinstance(rs, dict) and "rope_theta" in rs and "rope_theta" not in d:
            kw["rope_theta"] = float(rs["rope_theta"])

    n = kw.get("num_hidden_layers", 72)
    for k in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        v = d.get(k)
        if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):  # absent or [] = no clamp
            kw[k] = ()
            continue
        if not isinstance(v, (list, tuple)) or len(v) != n:
            err(f"{k} must be a list of num_hidden_layers={n} numbers, got length "
                f"{len(v) if isinstance(v, (list, tuple)) else type(v).__name__}")
        kw[k] = tuple(float(x or 0.0) for x in v)
        if any(x < 0 for x in kw[k]):
            err(f"{k} has a negative limit")
    cfg = LingConfig(**kw)
    _validate(cfg, err, d)
    return cfg


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
        if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs)):
            err(f"quantization_config.weight_block_size={bs!r} must be two positive integers")
    if not math.isfinite(c.rope_theta) or c.rope_theta <= 1:
        err(f"rope_theta={c.rope_theta} must be > 1")
    if c.rope_scaling is not None and c.rope_scaling.factor <= 0:
        err("rope_scaling.factor must be positive")
