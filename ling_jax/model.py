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

from ling_jax.call_mode import FORWARD, CallMode
from ling_jax.config import LingConfig
from ling_jax.decoder_layer import DecoderLayer
from ling_jax.kda import kda_zero_state
from ling_jax.exec_config import ExecConfig
from ling_jax.layer_stack import LayerStack, layer_of, layer_plan, per_layer, stack_forced, zeros_by_kind
from ling_jax.linear import Linear
from ling_jax.kv_quant import check_kv_cache_dtype
from ling_jax.mla import MLACache, mla_zero_cache
from ling_jax.norms import RMSNorm


class HybridCache(NamedTuple):
    """layers: per block of `layer_plan(cfg)`, per run, a KDAState or MLACache whose arrays are
    stacked `[repeats, n, B, ...]`; mtp: the MTP layer's MLACache `[B, S, ...]` (or None);
    lengths: [B] int32 tokens already cached per sequence; fresh: None or [B] bool, rows whose KDA
    states read as zero whatever the arrays hold (a new sequence in a reused engine slot; applied as
    each layer reads its state, so the pools are never copied to clear them). `layer_cache(cache,
    cfg, i)` reads layer i."""
    layers: tuple
    mtp: Optional[MLACache]
    lengths: jax.Array
    fresh: Optional[jax.Array] = None


def init_cache(cfg: LingConfig, batch: int, max_len: int, dtype, with_mtp: bool = True,
               kv_cache_dtype: str | None = None) -> HybridCache:
    """Zero cache: per KDA layer the f32 state [B,H,dk,dv] + 3 conv states [B,K-1,H*dk]; per MLA layer
    the latent [B,max_len,kv_lora_rank] + rotated key [B,max_len,rope_dim], laid out per block and
    run of the layer plan (`layer_stack.zeros_by_kind`). Sizes: `ling_jax.accounting.cache_bytes`.

    kv_cache_dtype: "auto"/None (the MLA cache in `dtype`) or "fp8" (float8_e4m3fn + per-token float32
    scales, `ling_jax.kv_quant`). A property of the cache, not an ExecConfig field: it is the layout
    of state the caller allocates and carries (jit sees it in the pytree), not a choice of kernel."""
    kv = check_kv_cache_dtype(kv_cache_dtype)
    layers = zeros_by_kind(cfg, lambda: kda_zero_state(cfg, batch, dtype),
                           lambda: mla_zero_cache(cfg, batch, max_len, dtype, kv))
    mtp = mla_zero_cache(cfg, batch, max_len, dtype, kv) if (with_mtp and cfg.has_mtp) else None
    return HybridCache(layers, mtp, jnp.zeros((batch,), jnp.int32))


def layer_cache(cache: HybridCache, cfg: LingConfig, layer: int):
    """The (unstacked) cache of main layer `layer`."""
    return layer_of(cfg, cache.layers, layer)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), jnp.float32).astype(dtype),
                                axes=("vocab", "embed"))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


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
        same slots. Returns (final-normed MTP hidden [B,T,D], new MLA cache, expert ids). The block is
        MLA: the call mode changes nothing in it (no KDA state to keep or roll back)."""
        m = self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(hidden_normed)], axis=-1), ex)
        if ex.remat is not None:  # rematerialised like the decoder layers (`layer_stack._layer_fn`)
            gdef, p = nnx.split(self.block)
            call = lambda p, m, c: nnx.merge(gdef, p)(m, c, lengths, n_valid, ex, forced_idx)
            r, cache, idx, _ = jax.checkpoint(call, policy=getattr(jax.checkpoint_policies, ex.remat))(p, m, cache)
        else:
            r, cache, idx, _ = self.block(m, cache, lengths, n_valid, ex, forced_idx)
        return self.final_layernorm(r), cache, idx


class LingModel(nnx.Module):
    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs, layer_loop: str = "scan"):
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = LayerStack(cfg, dtype=dtype, rngs=rngs, loop=layer_loop)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LingForCausalLM(nnx.Module):
    """Whole model. Parameter paths mirror the checkpoint names (`checkpoint.layout.checkpoint_names`).

    `exec` is the model's ExecConfig (how it runs; static under jit): by default the defaults of
    the current backend for this config (`ExecConfig.for_backend`). A call may pass another, with
    the same `layer_loop`: that one is how the layers are stored (`LayerStack`), chosen here, at
    build or load time; `set_layer_loop` converts.
    """

    def __init__(self, cfg: LingConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, with_mtp: bool = True,
                 exec: ExecConfig | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.exec = exec if exec is not None else ExecConfig.for_backend(None, cfg)
        self.model = LingModel(cfg, dtype=dtype, rngs=rngs, layer_loop=self.exec.layer_loop)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, axes=("vocab", "embed"), dtype=dtype, rngs=rngs)
        self.mtp = MTPLayer(cfg, dtype=dtype, rngs=rngs) if (with_mtp and cfg.has_mtp) else None

    def logits(self, z, exec: ExecConfig | None = None):
        return self.lm_head(z, exec or self.exec).astype(jnp.float32)

    def mtp_forward(self, next_ids, hidden, mtp_cache, lengths, n_valid, exec: ExecConfig | None = None):
        """MTP layer alone: slot t pairs token next_ids[t] with main hidden[t] at position lengths+t.

        Returns (mtp logits [B,T,V] f32, MTP final-normed hidden [B,T,D], new MTP cache).
        """
        ex = exec or self.exec
        zm, mtp_cache = self._mtp_layer(next_ids, hidden, mtp_cache, lengths, n_valid, ex)
        return self.logits(zm, ex), zm, mtp_cache

    def _mtp_layer(self, next_ids, hidden, mtp_cache, lengths, n_valid, ex: ExecConfig):
        """(MTP final-normed hidden [B,T,D], new MTP cache) of `mtp_forward`, without the logits."""
        emb = self.model.word_embeddings(next_ids).astype(self.dtype)
        zm, mtp_cache, _ = self.mtp(emb, hidden.astype(self.dtype), mtp_cache, lengths, n_valid, ex)
        return zm, mtp_cache

    def mtp_fill(self, mtp_cache, ids, hidden, prev_hidden, start, n_valid, exec: ExecConfig | None = None):
        """The MTP cache after feeding ids [B,T] (n_valid [B] real, from position start [B]) whose
        main hiddens are hidden [B,T,D]: MTP slot t pairs token t+1 with the main hidden at t
        (spec §11), so these tokens complete slots start-1 … start+n-2, the first with
        prev_hidden [B,D] (the last hidden of the previous call); a row starting at 0 completes
        0 … n-2 (its last slot waits for the next token). The one MTP fill of every prefill:
        `generate.prefill` and the engine's prefill chunks (rows fresh or carried, per row)."""
        ex = exec or self.exec
        B, T = ids.shape
        fresh = start == 0
        shifted = jnp.concatenate([ids[:, 1:], jnp.zeros((B, 1), ids.dtype)], axis=1)
        mtp_ids = jnp.where(fresh[:, None], shifted, ids)
        carried = jnp.concatenate([prev_hidden[:, None].astype(hidden.dtype), hidden[:, :-1]], axis=1)
        h = jnp.where(fresh[:, None, None], hidden, carried)
        m_start = jnp.where(fresh, 0, start - 1)
        m_n = jnp.where(fresh, jnp.maximum(n_valid - 1, 0), n_valid)
        return self._mtp_layer(mtp_ids, h, mtp_cache, m_start, m_n, ex)[1]

    def set_layer_loop(self, loop: str, *, free: bool = False) -> "LingForCausalLM":
        """Store the layers for `loop` ("scan" | "unroll", `LayerStack.set_loop`) and run that way.
        Outside any program; the parameter tree changes, so split the model again afterwards."""
        self.model.layers.set_loop(loop, free=free, loop_layouts=self.exec.loop_stack_layouts)
        self.exec = self.exec.replace(layer_loop=loop)
        return self

    def __call__(self, input_ids, cache: HybridCache | None = None, n_valid=None, *, mtp: bool = False,
                 exec: ExecConfig | None = None, forced_routing: dict | None = None, mtp_ids=None,
                 mode: CallMode = FORWARD):
        """Forward over T new tokens per sequence.

        input_ids: [B,T] int32. cache: None for a cache-free forward from position 0 (MLA attends
        to the T tokens only), else a HybridCache holding `cache.lengths[b]` tokens per sequence.
        n_valid: [B] real tokens (default T). mtp: also run the MTP layer; its ids default to the
        inputs shifted left with a 0 fill (spec §11), or `mtp_ids` [B,T] when given.
        exec: how to run (default `self.exec`; its layer_loop must be the stored one). mode: what the
        call is for (`CallMode`: forward, prefill [with snapshots every N], decode, verify, train).
        Returns dict: logits [B,T,V] f32 (absent with `mode.logits` False), hidden [B,T,D]
        (final-normed), cache, routing {layer: [B,T,k]}, mtp_logits [B,T,V] (if mtp), kda_states
        {(block, run): stacked rollback info} (a verify, for `kda_rollback`), kda_boundary_states
        {(block, run): stacked KDAState [repeats, n, B, J, ...]} (a prefill with `snapshot_every` N
        and J = T // N > 0; see `KimiDeltaAttention.__call__`).
        """
        cfg = self.cfg
        ex = exec or self.exec
        B, T = input_ids.shape
        n_valid = jnp.full((B,), T, jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
        lengths = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
        h = self.model.word_embeddings(input_ids).astype(self.dtype)
        new_layers, routing, kda_states = [], {}, {}
        stack = self.model.layers
        if cache is not None:
            caches = cache.layers
        else:  # cache-free: zero KDA states, MLA attends to the T new tokens only
            caches = zeros_by_kind(cfg, lambda: kda_zero_state(cfg, B, self.dtype), lambda: None)
        for b, block in enumerate(layer_plan(cfg)):
            forced = tuple(stack_forced(block, r, forced_routing) for r in range(len(block.runs)))
            h, new_c, idxs, extras = stack.run_block(b, h, caches[b], forced, lengths, n_valid, ex,
                                                     None if cache is None else cache.fresh, mode)
            new_layers.append(new_c)
            for r in range(len(block.runs)):
                if idxs[r] is not None:
                    routing.update(per_layer(block, r, idxs[r]))
                if extras[r] is not None:
                    kda_states[(b, r)] = extras[r]
        z = self.model.norm(h)
        out = {"hidden": z, "routing": routing}
        if mode.logits:  # a prefill only needs the last position's logits
            out["logits"] = self.logits(z, ex)
        if kda_states:  # per-token rollback info, or the states at prefill boundaries (CallMode)
            out["kda_states" if mode.kda_states else "kda_boundary_states"] = kda_states
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
