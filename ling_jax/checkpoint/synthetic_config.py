"""`synthetic_config`: the small built-in config of random-weight checkpoints.

Used where no config.json is given: the `ling-jax demo` fallback when the trained demo model is not
shipped, `tools/measure_bf16_drift.py` (the README's drift numbers are for this config), and the
checkpoint tests. It exercises every architectural feature at toy size: 9 layers (KDA 0-6, MLA 7,
trailing-group MLA 8), widths deliberately not multiples of 128, 8 experts in 4 groups, dense first
layers, SwiGLU clamps on the last layers and an MTP layer.
"""
from __future__ import annotations

from ling_jax.config import LingConfig


def synthetic_config(**overrides) -> LingConfig:
    """The 9-layer toy config; `overrides` are config.json fields. Unless overridden, the SwiGLU
    limit lists are sized to num_hidden_layers (clamp on the last layers)."""
    n = int(overrides.get("num_hidden_layers", 9))
    d = {
        "model_type": "bailing_hybrid", "vocab_size": 512, "hidden_size": 192, "num_hidden_layers": n,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 320,
        "rms_norm_eps": 1e-6, "pad_token_id": 510, "eos_token_id": 511, "layer_group_size": 8,
        "first_k_dense_replace": min(2, max(n - 1, 0)), "num_nextn_predict_layers": 1, "short_conv_kernel_size": 4,
        "kda_lower_bound": -5.0, "q_lora_rank": 96, "kv_lora_rank": 48, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "rope_theta": 6e6, "max_position_embeddings": 4096,
        "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 96,
        "moe_shared_expert_intermediate_size": 96, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    }
    d.update(overrides)
    n = d["num_hidden_layers"]
    d.setdefault("expert_swiglu_limit_list", [0.0] * max(n - 1, 0) + [4.0] * min(1, n))
    d.setdefault("share_expert_swiglu_limit_list", [0.0] * max(n - 2, 0) + [5.0] * min(1, max(n - 1, 0)) + [7.0] * min(1, n))
    return LingConfig.from_dict(d, "synthetic_config")
