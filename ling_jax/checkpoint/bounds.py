"""Bounding what a config.json claims by what the checkpoint files hold, before any per-tensor loop.

`layout.expected_tensors(cfg)` enumerates one entry per tensor: 3 * num_experts per MoE layer, a
dozen per layer. A config claiming `num_experts: 1000000000` (or a billion layers) would make that
enumeration, and everything after it, run for minutes before reporting anything. The reader first
compares the count given in closed form here with the number of tensors the shard headers list, and
refuses a config that claims far more than the files can possibly hold, naming the field.

`expected_tensor_count` must equal `len(layout.expected_tensors(cfg, include_mtp))` (a test checks
it on several configs); it costs O(1).
"""
from __future__ import annotations

from ling_jax.config import LingConfig

KDA_ATTENTION_TENSORS = 13  # q,k,v,f,g,o,b projections + 3 conv taps + A_log + dt_bias + o_norm
MLA_FIXED_TENSORS = 5       # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, g_proj, dense
MTP_EXTRA_TENSORS = 4       # enorm, hnorm, eh_proj, final_layernorm


def _mla_tensors(cfg: LingConfig) -> int:
    return MLA_FIXED_TENSORS + (1 if cfg.q_lora_rank is None else 3)


def _moe_tensors(cfg: LingConfig) -> int:
    shared = 3 if cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts > 0 else 0
    return 2 + 3 * cfg.num_experts + shared  # router weight + expert_bias + experts + shared expert


def num_mla_layers(cfg: LingConfig) -> int:
    """Main MLA layers by the schedule rule (spec §3), without building `layer_types`."""
    g, n = cfg.layer_group_size, cfg.num_hidden_layers
    full = (n // g) * g
    return n // g + (n - full)


def expected_tensor_count(cfg: LingConfig, include_mtp: bool = True) -> int:
    """Number of weight tensors (scales excluded) of the release for `cfg`, in O(1)."""
    n = cfg.num_hidden_layers
    n_mla = num_mla_layers(cfg)
    n_moe = max(n - cfg.first_k_dense_replace, 0)
    count = 3  # embeddings, final norm, lm_head
    count += 2 * n  # input / post-attention layernorms
    count += n_mla * _mla_tensors(cfg) + (n - n_mla) * KDA_ATTENTION_TENSORS
    count += n_moe * _moe_tensors(cfg) + (n - n_moe) * 3
    if cfg.has_mtp and include_mtp:
        count += MTP_EXTRA_TENSORS + 2 + _mla_tensors(cfg) + _moe_tensors(cfg)
    return count


def check_claims(cfg: LingConfig, n_stored: int, cfg_file: str, index_file: str, include_mtp: bool = True):
    """None if `cfg` is plausible for a checkpoint whose headers list `n_stored` tensors, else the
    refusal message naming the field that claims far more (the caller raises it)."""
    want = expected_tensor_count(cfg, include_mtp)
    if want <= 2 * n_stored + 64:  # leave room for the ordinary missing-tensor report
        return None
    per_layer_moe = _moe_tensors(cfg)
    if cfg.num_experts > 0 and 3 * cfg.num_experts > n_stored:
        what = f"num_experts={cfg.num_experts} ({per_layer_moe} tensors per MoE layer)"
    elif cfg.num_hidden_layers > n_stored:
        what = f"num_hidden_layers={cfg.num_hidden_layers}"
    else:
        what = "its layer and expert counts"
    return (f"{cfg_file}: {what} implies {want:,} weight tensors, but {index_file} lists only {n_stored:,} "
            f"(config.json does not describe this checkpoint)")
