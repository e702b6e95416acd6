"""One decoder layer: attention (KDA or MLA) and a feed-forward (dense SwiGLU or MoE), pre-normed
with residuals (spec §4). `LayerStack` stores these per layer or stacked per run of the layer plan."""
from __future__ import annotations

from flax import nnx

from ling_jax.call_mode import FORWARD, CallMode
from ling_jax.config import KDA, LingConfig
from ling_jax.exec_config import ExecConfig
from ling_jax.kda import KimiDeltaAttention
from ling_jax.mla import MultiheadLatentAttention
from ling_jax.moe import ExpertTable, MoE
from ling_jax.norms import RMSNorm
from ling_jax.swiglu import SwiGLU


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LingConfig, layer: int, *, dtype, rngs: nnx.Rngs, attn_type: str | None = None):
        self.attn_type = attn_type or (cfg.layer_types[layer] if layer < cfg.num_hidden_layers else "mla")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if self.attn_type == KDA:
            self.attention = KimiDeltaAttention(cfg, dtype=dtype, rngs=rngs)
        else:
            self.attention = MultiheadLatentAttention(cfg, dtype=dtype, rngs=rngs)
        self.is_moe = cfg.is_moe(layer)
        self.mlp = (MoE(cfg, layer, dtype=dtype, rngs=rngs) if self.is_moe
                    else SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs))

    def __call__(self, h, cache, lengths, n_valid, ex: ExecConfig, forced_idx=None, mode: CallMode = FORWARD,
                 experts: ExpertTable | None = None):
        """h: [B,T,D] → (h, new layer cache, routed expert ids or None, KDA rollback info or boundary
        states or None); mode: what the call is for (`CallMode`: the KDA form and what it returns);
        experts: this layer's routed experts in its scanned run's table (`moe.ExpertTable`)."""
        a_in = self.input_layernorm(h)
        extra = None
        if self.attn_type == KDA:
            a, cache, extra = self.attention(a_in, cache, n_valid, ex, mode)
        else:
            a, cache = self.attention(a_in, cache, lengths, n_valid, ex)
        u = h + a
        m_in = self.post_attention_layernorm(u)
        idx = None
        if self.is_moe:
            m, idx = self.mlp(m_in, ex, forced_idx, n_valid, experts)
        else:
            m = self.mlp(m_in, ex)
        return u + m, cache, idx, extra
