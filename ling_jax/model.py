"""The Ling model: decoder layers, final norm, LM head and the MTP layer (spec §4, §11).

Caches are explicit pytrees (`HybridCache`) passed in and returned, so the same module serves a
cache-free forward (logits of a whole sequence), a prefill, a decode step and a speculative
verify. Batches are right-padded: `n_valid[b]` of the T new tokens are real.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import KDA, LingConfig
from ling_jax.kda import KimiDeltaAttention, kda_zero_state
from ling_jax.exec_config import ExecConfig
from ling_jax.layer_stack import layer_plan, per_layer, run_block, stack_forced, stack_params
from ling_jax.linear import Linear
from ling_jax.kv_quant import check_kv_cache_dtype
from ling_jax.mla import MLACache, MultiheadLatentAttention, mla_zero_cache
from ling_jax.moe import MoE
from ling_jax.norms import RMSNorm
from ling_jax.swiglu import SwiGLU


class HybridCache(NamedTuple):
    """layers: per block of `layer_plan(cfg)`, per run, a KDAState or MLACache whose arrays are
    stacked `[repeats, n, B, ...]`; mtp: the MTP layer's MLACache `[B, S, ...]` (or None);
    lengths: [B] int32 tokens already cached per sequence. `layer_cache(cache, cfg, i)` reads layer i."""
    layers: tuple
    mtp: Optional[MLACache]
    lengths: jax.Array


def _stacked(make, block, r):
    m, n = block.repeats, block.runs[r].n
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (m, n) + x.shape).copy(), make())


def init_cache(cfg: LingConfig, batch: int, max_len: int, dtype, with_mtp: bool = True,
               kv_cache_dtype: str | None = None) -> HybridCache:
    """Zero cache: per KDA layer the f32 state [B,H,dk,dv] + 3 conv states [B,K-1,H*dk]; per MLA layer
    the latent [B,max_len,kv_lora_rank] + rotated key [B,max_len,rope_dim]. Sizes: `ling_jax.accounting.cache_bytes`.

    kv_cache_dtype: "auto"/None (the MLA cache in `dtype`) or "fp8" (float8_e4m3fn + per-token float32
    scales, `ling_jax.kv_quant`). A property of the cache, not an ExecConfig field: it is the layout
    of state the caller allocates and carries (jit sees it in the pytree), not a choice of kernel."""
    kv = check_kv_cache_dtype(kv_cache_dtype)
    layers = tuple(tuple(_stacked((lambda: kda_zero_state(cfg, batch, dtype)) if run.attn == KDA
                                  else (lambda: mla_zero_cache(cfg, batch, max_len, dtype, kv)), b, r)
                         for r, run in enumerate(b.runs)) for b in layer_plan(cfg))
    mtp = mla_zero_cache(cfg, batch, max_len, dtype, kv) if (with_mtp and cfg.has_mtp) else None
    return HybridCache(layers, mtp, jnp.zeros((batch,), jnp.int32))


def layer_cache(cache: HybridCache, cfg: LingConfig, layer: int):
    """The (unstacked) cache of main layer `layer`."""
    for b, block in enumerate(layer_plan(cfg)):
        for r in range(len(block.runs)):
            for g, row in enumerate(block.layer_grid(r)):
                if layer in row:
                    return jax.tree.map(lambda x: x[g, row.index(layer)], cache.layers[b][r])
    raise IndexError(f"layer {layer} out of range")


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), jnp.float32).astype(dtype),
                                axes=("vocab", "embed"))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


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

    def __call__(self, h, cache, lengths, n_valid, ex: ExecConfig, forced_idx=None):
        """h: [B,T,D] → (h, new layer cache, routed expert ids or None, KDA rollback info or None)."""
        a_in = self.input_layernorm(h)
        extra = None
        if self.attn_type == KDA:
            a, cache, extra = self.attention(a_in, cache, n_valid, ex)
        else:
            a, cache = self.attention(a_in, cache, lengths, n_valid, ex)
        u = h + a
        m_in = self.post_attention_layernorm(u)
        idx = None
        if self.is_moe:
            m, idx = self.mlp(m_in, ex, forced_idx)
        else:
            m = self.mlp(m_in, ex)
        return u + m, cache, idx, extra


class MTPLayer(nnx.Module):
    """Next-token-after-next draft layer (checkpoint index N = num_hidden_layers)."""

    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * D, D, axes=("embed", "embed_cat"), dtype=dtype, rngs=rngs)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers, dtype=dtype, rngs=rngs, attn_type="mla")
        self.final_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)

    def __call__(self, emb, hidden_normed, cache, lengths, n_valid, ex: ExecConfig, forced_idx=None):
        """emb: embeddings of the *next* tokens [B,T,D]; hidden_normed: main final-normed hidden at the
        same slots. Returns (final-normed MTP hidden [B,T,D], new MLA cache, expert ids)."""
        m = self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(hidden_normed)], axis=-1), ex)
        ex = ex.replace(kda_states=False)  # the MTP block is MLA: nothing to roll back
        if ex.remat is not None:  # rematerialised like the decoder layers (`layer_stack._layer_fn`)
            gdef, p = nnx.split(self.block)
            call = lambda p, m, c: nnx.merge(gdef, p)(m, c, lengths, n_valid, ex, forced_idx)
            r, cache, idx, _ = jax.checkpoint(call, policy=getattr(jax.checkpoint_policies, ex.remat))(p, m, cache)
        else:
            r, cache, idx, _ = self.block(m, cache, lengths, n_valid, ex, forced_idx)
        return self.final_layernorm(r), cache, idx


class LingModel(nnx.Module):
    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs):
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LingForCausalLM(nnx.Module):
    """Whole model. Parameter paths mirror the checkpoint names (`checkpoint.layout.checkpoint_names`).

    `exec` is the model's ExecConfig (how it runs; static under jit): by default the defaults of
    the current backend for this config (`ExecConfig.for_backend`). A call may pass another.
    """

    def __init__(self, cfg: LingConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, with_mtp: bool = True,
                 exec: ExecConfig | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.exec = exec if exec is not None else ExecConfig.for_backend(None, cfg)
        self.model = LingModel(cfg, dtype=dtype, rngs=rngs)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, axes=("vocab", "embed"), dtype=dtype, rngs=rngs)
        self.mtp = MTPLayer(cfg, dtype=dtype, rngs=rngs) if (with_mtp and cfg.has_mtp) else None

    def logits(self, z, exec: ExecConfig | None = None):
        return self.lm_head(z, exec or self.exec).astype(jnp.float32)

    def mtp_forward(self, next_ids, hidden, mtp_cache, lengths, n_valid, exec: ExecConfig | None = None):
        """MTP layer alone: slot t pairs token next_ids[t] with main hidden[t] at position lengths+t.

        Returns (mtp logits [B,T,V] f32, MTP final-normed hidden [B,T,D], new MTP cache).
        """
        ex = exec or self.exec
        emb = self.model.word_embeddings(next_ids).astype(self.dtype)
        zm, mtp_cache, _ = self.mtp(emb, hidden.astype(self.dtype), mtp_cache, lengths, n_valid, ex)
        return self.logits(zm, ex), zm, mtp_cache

    def stacked_layers(self, exec: ExecConfig | None = None):
        """Per block of the layer plan: per run (graphdef, params stacked [repeats, n, ...]). Compute it
        once outside a decode loop and pass it as `stacked=`, so the loop body does not re-stack.
        None when the layers run unrolled (they read their own parameters)."""
        if (exec or self.exec).layer_loop == "unroll":
            return None
        return [stack_params(self.model.layers, b) for b in layer_plan(self.cfg)]

    def __call__(self, input_ids, cache: HybridCache | None = None, n_valid=None, *, mtp: bool = False,
                 exec: ExecConfig | None = None, forced_routing: dict | None = None, mtp_ids=None, stacked=None):
        """Forward over T new tokens per sequence.

        input_ids: [B,T] int32. cache: None for a cache-free forward from position 0 (MLA attends
        to the T tokens only), else a HybridCache holding `cache.lengths[b]` tokens per sequence.
        n_valid: [B] real tokens (default T). mtp: also run the MTP layer; its ids default to the
        inputs shifted left with a 0 fill (spec §11), or `mtp_ids` [B,T] when given.
        exec: how to run (default `self.exec`); `stacked`: `stacked_layers()` computed once outside a loop.
        Returns dict: logits [B,T,V] f32 (absent with `exec.skip_logits`), hidden [B,T,D]
        (final-normed), cache, routing {layer: [B,T,k]}, mtp_logits [B,T,V] (if mtp), kda_states
        {(block, run): stacked rollback info} (with `exec.kda_states`, for `kda_rollback`),
        kda_boundary_states {(block, run): stacked KDAState [repeats, n, B, J, ...]} (with
        `exec.kda_boundary_states` and J = T // it > 0; see `KimiDeltaAttention.__call__`).
        """
        cfg = self.cfg
        ex = exec or self.exec
        B, T = input_ids.shape
        n_valid = jnp.full((B,), T, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
        lengths = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
        h = self.model.word_embeddings(input_ids).astype(self.dtype)
        new_layers, routing, kda_states = [], {}, {}
        for b, block in enumerate(layer_plan(cfg)):
            if cache is not None:
                caches = cache.layers[b]
            else:  # cache-free: zero KDA states, MLA attends to the T new tokens only
                caches = tuple(_stacked(lambda: kda_zero_state(cfg, B, self.dtype), block, r) if run.attn == KDA
                               else None for r, run in enumerate(block.runs))
            forced = tuple(stack_forced(block, r, forced_routing) for r in range(len(block.runs)))
            h, new_c, idxs, extras = run_block(block, self.model.layers, None if stacked is None else stacked[b],
                                               h, caches, forced, lengths, n_valid, ex)
            new_layers.append(new_c)
            for r in range(len(block.runs)):
                if idxs[r] is not None:
                    routing.update(per_layer(block, r, idxs[r]))
                if extras[r] is not None:
                    kda_states[(b, r)] = extras[r]
        z = self.model.norm(h)
        out = {"hidden": z, "routing": routing}
        if not ex.skip_logits:  # prefill only needs the last position's logits
            out["logits"] = self.logits(z, ex)
        if kda_states:  # per-token rollback info, or the states at prefill boundaries (ExecConfig)
            out["kda_states" if ex.kda_states else "kda_boundary_states"] = kda_states
        mtp_cache = None if cache is None else cache.mtp
        if mtp:
            if self.mtp is None:
                raise ValueError("this model has no MTP layer (num_nextn_predict_layers = 0 or loaded without it)")
            if mtp_ids is None:
                t = jnp.arange(T)[None, :]
                nxt = jnp.concatenate([input_ids[:, 1:], jnp.zeros((B, 1), input_ids.dtype)], axis=1)
                mtp_ids = jnp.where(t + 1 < n_valid[:, None], nxt, 0)
            emb = self.model.word_embeddings(mtp_ids).astype(self.dtype)
            forced = None if forced_routing is None else forced_routing.get(cfg.num_hidden_layers)
            zm, mtp_cache, idx = self.mtp(emb, z, mtp_cache, lengths, n_valid, ex, forced)
            out["mtp_logits"] = self.logits(zm, ex)
            routing[cfg.num_hidden_layers] = idx
        if cache is not None:
            out["cache"] = HybridCache(tuple(new_layers), mtp_cache, lengths + n_valid)
        return out
