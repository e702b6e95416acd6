"""Kimi Delta Attention (spec §9): short convs, bounded gate, and the gated delta rule.

The delta rule itself runs over the state `[batch, heads, key=128, value=128]` (float32) in
`pallas_kernels.kda`: its XLA reference (`kda_chunk_scan` for prefill, `kda_recurrent_scan` /
`kda_recurrent_step` for decode) or the Pallas kernels. Padding is handled by giving pad tokens
`g = 0` (no decay) and `beta = 0` (no write): the state passes through them unchanged.
"""
from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.config import LingConfig
from ling_jax.call_mode import FORWARD, CallMode
from ling_jax.exec_config import ExecConfig
from ling_jax.kernel_mesh import on_mesh
from ling_jax.linear import Linear
from ling_jax.norms import gated_rms_norm, l2_normalize
from ling_jax.ops import real_tokens
from ling_jax.placement import param_mesh
from ling_jax.rows import put_rows, take_rows
from pallas_kernels.kda import cpu_kernel
from pallas_kernels.kda.chunk_kernel import kda_chunk_scan_pallas
from pallas_kernels.kda.reference import kda_chunk_scan, kda_recurrent_scan
from pallas_kernels.kda.step_kernel import kda_recurrent_scan_pallas


class KDAState(NamedTuple):
    """Per-layer KDA cache. recurrent: [B,H,dk,dv] f32; conv_*: [B,K-1,H*dk] raw pre-conv inputs (a
    window), or, in the engine's slot pools on TPU (`ExecConfig.pool_layout="token_rows"`), the
    window's K-1 taps as a tuple of [B,H*dk] arrays (`conv_taps`; `conv_window` gives the window back)."""
    recurrent: jax.Array
    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array


class SlotKDAState(NamedTuple):
    """A KDA cache whose recurrent states stay where they are stored: a decode call updates them in
    place (`kda_in_place`), with no gather of its rows out of the slot pool and no scatter back.

    recurrent: the whole stacked pool [repeats, n, S, H, dk, dv] f32 (S slots; the engine's slot pool,
    or `generate`'s batch); conv_*: the rows' conv states, stacked [repeats, n, R, K-1, H*dk] or as
    taps (`conv_taps`; one layer's window [R, K-1, H*dk] once `layer` is set); rows [R] int32: the
    slots of the call's rows (>= S: a padding row); fresh [R] bool or None: rows whose state starts at
    zero; layer: None, or (g, j) of the layer reading it (`layer_stack._cache_at`, Python or traced
    ints)."""
    recurrent: jax.Array
    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    rows: jax.Array
    fresh: Optional[jax.Array] = None
    layer: Optional[tuple] = None


def kda_in_place(ex: ExecConfig, mode: CallMode, dtype) -> bool:
    """Whether a call keeps its KDA states in their pool (`SlotKDAState`) and runs the native CPU
    kernel on them (`pallas_kernels.kda.cpu_kernel`): token-by-token calls that need no per-token
    states (decode; a verify keeps the reference scan for its rollback), `ex.native_kda` with the
    XLA kernels, float32 states, the kernel built. Callers also need the model on one device (the
    kernel is not partitioned): `layer_stack` and the engine check that."""
    return (mode.kda_recurrent and not mode.kda_states and ex.native_kda and ex.kernels == "xla"
            and jnp.dtype(dtype) == jnp.float32 and cpu_kernel.available())


def kda_zero_state(cfg: LingConfig, batch: int, dtype, taps: bool = False) -> KDAState:
    """Zero KDA cache of `batch` rows; taps: the conv windows stored as taps (`conv_taps`: the engine's
    pools on TPU; a kernel of one tap keeps the empty window)."""
    H, d, K = cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
    if taps and K > 1:  # distinct buffers (they may be donated)
        conv = lambda: tuple(jnp.zeros((batch, H * d), dtype) for _ in range(K - 1))
    else:
        conv = lambda: jnp.zeros((batch, K - 1, H * d), dtype)
    return KDAState(jnp.zeros((batch, H, d, d), jnp.float32), conv(), conv(), conv())


CONV_FIELDS = ("conv_q", "conv_k", "conv_v")


def conv_window(x) -> jax.Array:
    """A conv state as the window the layer reads, [..., K-1, C]: taps (a tuple of K-1 [..., C]
    arrays) stacked, a window as it is."""
    return jnp.stack(x, axis=-2) if isinstance(x, tuple) else x


def conv_taps(window: jax.Array, like):
    """`window` [..., K-1, C] in the form of `like`: its K-1 taps [..., C] when `like` is a tuple of
    taps, else the window itself.

    Why the engine's pools keep taps on TPU: a window's K-1 = 3 rows sit in the tiled second-minor
    dimension, and the programs that gather slot rows (a decode of fewer rows than slots, prefill)
    copied every conv pool into another tiling and back each step (tests/test_aot.py). A tap
    [S, H*dk] is lane-dense: no program copies it."""
    if not isinstance(like, tuple):
        return window
    return tuple(window[..., k, :] for k in range(len(like)))


def conv_like(state, like):
    """`state` (a KDAState) with each conv state in the form `like`'s has (`conv_taps`)."""
    return state._replace(**{f: conv_taps(conv_window(getattr(state, f)), getattr(like, f)) for f in CONV_FIELDS})


def short_conv(u: jax.Array, taps: jax.Array, conv_state: jax.Array, n_valid: jax.Array, return_cat: bool = False):
    """Causal depthwise conv + SiLU over raw projections (spec §9.2).

    u: [B,T,C]; taps: [C,K] (tap K-1 multiplies the current token); conv_state: [B,K-1,C] (the
    previous K-1 raw inputs); n_valid: [B] number of real tokens (the rest are right padding).
    Returns (y [B,T,C], new conv_state holding the last K-1 *valid* raw inputs[, the concatenation
    [B,K-1+T,C] from which the state after any prefix can be sliced (speculative rollback)]).
    """
    K = taps.shape[1]
    T = u.shape[1]
    x = jnp.concatenate([conv_state.astype(u.dtype), u], axis=1)  # [B, K-1+T, C]
    acc = jnp.zeros(u.shape, jnp.float32)
    for j in range(K):
        acc = acc + x[:, j:j + T].astype(jnp.float32) * taps[:, j].astype(jnp.float32)
    y = jax.nn.silu(acc).astype(u.dtype)
    if return_cat:
        return y, conv_state_at(x, n_valid, K), x
    return y, conv_state_at(x, n_valid, K)


def conv_state_at(x_cat: jax.Array, n: jax.Array, K: int) -> jax.Array:
    """Conv state after the first n[b] new tokens: rows n..n+K-2 of [old state; new raw inputs]."""
    return jax.vmap(lambda xb, nb: jax.lax.dynamic_slice_in_dim(xb, nb, K - 1, axis=0))(x_cat, n)


def kda_gate(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array, lower_bound: float) -> jax.Array:
    """Bounded log-decay `L·σ(exp(A_log)·(f + dt_bias))` (spec §9.3). f: [B,T,H,dk] → f32, in (L, 0)."""
    f32 = f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(f.shape[-2:])
    return lower_bound * jax.nn.sigmoid(jnp.exp(A_log.astype(jnp.float32))[:, None] * f32)


class KimiDeltaAttention(nnx.Module):
    """KDA attention block: projections → short convs → gate/beta/L2 → delta rule → gated norm → o_proj."""

    def __init__(self, cfg: LingConfig, *, dtype, rngs: nnx.Rngs):
        D, H, d, K = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.short_conv_kernel_size
        P = H * d
        self.cfg = cfg
        for name in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):  # [H*dk, D]
            setattr(self, name, Linear(D, P, axes=("heads", "embed"), dtype=dtype, rngs=rngs))
        self.b_proj = Linear(D, H, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(P, D, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            taps = jax.random.normal(rngs.params(), (P, K), jnp.float32) / K
            # checkpoint [P,1,K] squeezed to [P,K]
            setattr(self, name, nnx.Param(taps.astype(dtype), axes=("heads", "conv")))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (H,), jnp.float32, 1.0, 16.0)),
                               axes=("heads",))
        self.dt_bias = nnx.Param(jnp.zeros((P,), jnp.float32), axes=("heads",))
        self.o_norm = nnx.Param(jnp.ones((d,), dtype), axes=("head_dim",))  # gated RMSNorm weight shared by heads

    def _per_head(self, kernel, ex: ExecConfig | None, q, k, v, g, beta, s0, chunk_states: bool = False):
        """kernel(q, k, v, g, beta, s0) -> (o, state[, chunk states]), per device on its own heads when
        the model runs on a mesh (`kernel_mesh.on_mesh`: a Pallas kernel cannot be partitioned by XLA)."""
        mesh = param_mesh(self.A_log)  # where this layer's parameters were placed (static under jit)
        if ex is None or mesh is None:
            return kernel(q, k, v, g, beta, s0)
        t4 = ("batch", None, "heads", None)
        outs = ((("batch", None, "heads", None), ("batch", "heads", None, None))
                + ((("batch", None, "heads", None, None),) if chunk_states else ()))
        return on_mesh(kernel, mesh, (t4, t4, t4, t4, ("batch", None, "heads"), ("batch", "heads", None, None)),
                       outs, (q, k, v, g, beta, s0), heads=self.cfg.num_attention_heads)

    def __call__(self, x, state: KDAState, n_valid, ex: ExecConfig, mode: CallMode = FORWARD):
        """x: [B,T,D]; n_valid: [B] real tokens per row (right padding after).

        ex: `ex.kda_chunk` tokens per chunk, `ex.kernels` xla | pallas (the KDA kernels and the FP8
        matmul of quantised projections). mode: chunked (forward, prefill, train) or recurrent
        (decode, verify) KDA (`CallMode`).

        Returns (out [B,T,D], new KDAState, extra or None). With a verify `mode` extra is the rollback
        info (recurrent states before and after every token [B,1+T,H,dk,dv], (q, k, v) raw conv inputs
        [B,K-1+T,P]) so a speculative verify can roll back to any accepted prefix, the empty one
        included, without the state it started from (`kda_rollback`: the engine's slot pool is
        updated in place, so the old state is gone).
        With a prefill `mode.snapshot_every` = N and J = T // N > 0, extra is a KDAState of the
        states after N, 2N, .., JN tokens of each row: recurrent [B,J,H,dk,dv], conv_* [B,J,K-1,P]
        (only boundaries within a row's n_valid tokens mean anything: past them the conv states
        hold padding's raw inputs; the engine reads none of those).
        """
        cfg = self.cfg
        B, T, _ = x.shape
        H, d = cfg.num_attention_heads, cfg.head_dim
        stride = mode.snapshot_every
        n_bounds = T // stride if stride else 0
        valid = real_tokens(n_valid, T)  # [B,T]
        convs = [short_conv(getattr(self, f"{n}_proj")(x, ex), getattr(self, f"{n}_conv1d")[...],
                            getattr(state, f"conv_{n}"), n_valid, return_cat=mode.kda_states or n_bounds > 0)
                 for n in "qkv"]
        (q, cq), (k, ck), (v, cv) = [c[:2] for c in convs]
        q = l2_normalize(q.reshape(B, T, H, d)) * (d ** -0.5)
        k = l2_normalize(k.reshape(B, T, H, d))
        v = v.reshape(B, T, H, d).astype(jnp.float32)
        g = kda_gate(self.f_proj(x, ex).reshape(B, T, H, d), self.A_log[...], self.dt_bias[...],
                     cfg.kda_lower_bound)
        beta = jax.nn.sigmoid(self.b_proj(x, ex).astype(jnp.float32))
        g = jnp.where(valid[..., None, None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
        if x.dtype == jnp.bfloat16:  # the chunked reference kernel stores normalised q/k in bf16
            q, k = q.astype(jnp.bfloat16).astype(jnp.float32), k.astype(jnp.bfloat16).astype(jnp.float32)
        all_states = extra = None
        if isinstance(state, SlotKDAState):
            return self._finish(x, *self._slot_scan(state, q, k, v, g, beta, ex, mode), (cq, ck, cv), None, ex)
        pallas = ex.kernels == "pallas"
        def pallas_chunk_scan(q, k, v, g, beta, s0, chunk, return_chunk_states=False):
            kern = partial(kda_chunk_scan_pallas, chunk_size=chunk, platform=ex.platform,
                           return_chunk_states=return_chunk_states)
            return self._per_head(kern, ex, q, k, v, g, beta, s0, chunk_states=return_chunk_states)

        # the gate is bounded below by kda_lower_bound: the XLA scan may factor its decays (reference.py)
        chunk_scan = pallas_chunk_scan if pallas else partial(kda_chunk_scan, gate_floor=cfg.kda_lower_bound)
        if mode.kda_states:  # every per-token state is materialised anyway: the reference scan
            o, s, all_states = kda_recurrent_scan(q, k, v, g, beta, state.recurrent, return_all_states=True)
        elif mode.kda_recurrent:
            step = partial(kda_recurrent_scan_pallas, platform=ex.platform) if pallas else kda_recurrent_scan
            o, s = self._per_head(step, ex if pallas else None, q, k, v, g, beta, state.recurrent)
        elif n_bounds:  # chunk ends on every boundary: chunks of gcd(kda_chunk, stride) tokens
            ch = math.gcd(ex.kda_chunk, stride)
            o, s, chunk_states = chunk_scan(q, k, v, g, beta, state.recurrent, ch, return_chunk_states=True)
            ends = [(j + 1) * stride for j in range(n_bounds)]
            K = cfg.short_conv_kernel_size
            extra = KDAState(chunk_states[:, [e // ch - 1 for e in ends]],
                             *(jnp.stack([c[2][:, e:e + K - 1] for e in ends], axis=1) for c in convs))
        else:
            o, s = chunk_scan(q, k, v, g, beta, state.recurrent, ex.kda_chunk)
        if mode.kda_states:
            extra = (jnp.concatenate([state.recurrent[:, None].astype(all_states.dtype), all_states], axis=1),
                     tuple(c[2] for c in convs))
        return self._finish(x, o, KDAState(s, cq, ck, cv), (cq, ck, cv), extra, ex)

    def _finish(self, x, o, new, convs, extra, ex: ExecConfig):
        """The output projection of the delta rule's o [B,T,H,dv]; `new` gets the new conv states."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, d = cfg.num_attention_heads, cfg.head_dim
        gate = self.g_proj(x, ex).reshape(B, T, H, d)
        y = gated_rms_norm(o.astype(x.dtype), gate, self.o_norm[...], cfg.rms_norm_eps).astype(x.dtype)
        out = self.o_proj(y.reshape(B, T, H * d), ex)
        return out, new._replace(conv_q=convs[0], conv_k=convs[1], conv_v=convs[2]), extra

    def _slot_scan(self, state: SlotKDAState, q, k, v, g, beta, ex: ExecConfig, mode: CallMode):
        """The delta rule token by token on the rows' states where they lie (`SlotKDAState`): the
        native kernel in place, or (no kernel, a mesh, another dtype) its XLA twin: the rows read
        out of the pool, `kda_recurrent_scan`, written back. Returns (o, the state with the new pool)."""
        if mode.kda_states or not mode.kda_recurrent:
            raise ValueError(f"a SlotKDAState is for decode calls, not a {mode.kind!r} call (`kda_in_place`)")
        pool, g_j = state.recurrent, state.layer
        if g_j is None:
            raise ValueError("SlotKDAState.layer is not set (the layer stack sets it for the layer reading it)")
        if kda_in_place(ex, mode, pool.dtype) and param_mesh(self.A_log) is None:
            o, pool = cpu_kernel.kda_recurrent_rows_cpu(pool, state.rows, q, k, v, g, beta, fresh=state.fresh,
                                                        layer=g_j)
            return o, state._replace(recurrent=pool)
        mine = jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(pool, g_j[0], 0, False), g_j[1], 0, False)
        s0 = take_rows(mine, state.rows, axis=0)
        if state.fresh is not None:
            s0 = jnp.where(state.fresh[:, None, None, None], 0.0, s0)
        o, s = kda_recurrent_scan(q, k, v, g, beta, s0.astype(jnp.float32))
        mine = put_rows(mine, state.rows, s)
        pool = jax.lax.dynamic_update_slice(pool, mine[None, None], (g_j[0], g_j[1]) + (0,) * mine.ndim)
        return o, state._replace(recurrent=pool)


def kda_rollback(rollback, n_keep: jax.Array) -> KDAState:
    """The KDA cache after only the first n_keep[b] of a verify chunk's tokens (0 = unchanged), from
    the rollback info alone (`KimiDeltaAttention.__call__` in a verify call)."""
    all_states, cats = rollback
    K = cats[0].shape[1] - (all_states.shape[1] - 1) + 1
    rec = jnp.take_along_axis(all_states, n_keep[:, None, None, None, None], axis=1)[:, 0]
    return KDAState(rec, *(conv_state_at(c, n_keep, K) for c in cats))
