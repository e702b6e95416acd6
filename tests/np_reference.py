"""Independent float64 NumPy reference of Ling-3.1-flash (BailingMoeV3, ``bailing_hybrid``).

Written from the specification ``shared/spec/ling-3.1-flash.md`` only (section numbers below refer
to it).  It is the ground truth the JAX implementation is tested against, so it favours clarity over
speed: everything is float64, one sequence at a time (no batch dimension), no BF16 rounding.

Conventions
-----------
* ``params`` is a ``dict[str, array]`` keyed by the exact HF checkpoint names of spec §12
  (``model.layers.3.attention.q_proj.weight`` ...), already dequantized, any float dtype.  Every
  tensor is converted to float64 on use.  Matrices are ``[out, in]`` and ``y = x @ W.T``.
* ``cfg`` is a :class:`ling_jax.config.LingConfig` (only plain parsed fields are read; the layer
  schedule and the SwiGLU limits are derived here from the spec rules, not from the config's helpers).
* Module ``prefix`` arguments may be given either as the layer prefix (``"model.layers.3"``) or as
  the module prefix (``"model.layers.3.attention"`` / ``"model.layers.3.mlp"``); a trailing dot is
  allowed.
* Shapes are written ``[T, D]`` etc.  ``H`` = heads, ``dk = dv = head_dim`` for KDA.

Decisions where the spec leaves room (also listed in the lead's report):
* ``kda_recurrent`` / ``kda_chunked`` take **raw** q, k (post short-conv, pre-L2) by default and do
  the L2 normalisation and the ``1/sqrt(dk)`` query scale inside (``normalize=True``); pass
  ``normalize=False`` to feed already-normalised/scaled q, k.
* ``q_a_layernorm`` and ``kv_a_layernorm`` use eps = 1e-6 regardless of ``rms_norm_eps`` (§5.1, §15.17).
* Router renormalisation: applied whenever ``top_k > 1`` (§8.1 step 7, "the reference always
  renormalizes when k > 1"); for ``top_k == 1`` it follows ``norm_topk_prob``.
* The SwiGLU clamp is controlled by the ``clamp`` argument only (``cfg.apply_swiglu_clamp`` is not read).
* MTP id shift across split calls: ``forward`` takes ``mtp_next_id`` — the id that follows the last
  input id, when known.  ``None`` means the spec's 0 fill (§11 step 1).  A sequence split in two
  calls reproduces the one-call MTP logits when the first call gets ``mtp_next_id=ids[split]``.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

F64 = np.float64
KDA = "kda"
MLA = "mla"
QK_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm class default (§5.1)


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------
def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=F64)


def _w(params: dict, name: str) -> np.ndarray:
    try:
        return _f64(params[name])
    except KeyError:
        raise KeyError(f"np_reference: missing parameter {name!r}") from None


def _module_prefix(prefix: str, module: str) -> str:
    """'model.layers.3' or 'model.layers.3.attention' (trailing dot ok) -> 'model.layers.3.attention'."""
    p = prefix.rstrip(".")
    if p.split(".")[-1] != module:
        p = f"{p}.{module}"
    return p


def sigmoid(x):
    x = _f64(x)
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic


def silu(x):
    x = _f64(x)
    return x * sigmoid(x)


def softmax(x, axis=-1):
    x = _f64(x)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _rs_get(rs: Any, name: str, default=None):
    """Read a field of cfg.rope_scaling whether it is a dataclass or a dict."""
    if rs is None:
        return default
    if isinstance(rs, dict):
        v = rs.get(name, default)
    else:
        v = getattr(rs, name, default)
    return default if v is None else v


# ------------------------------------------------------------------------------------------------
# §3 layer schedule
# ------------------------------------------------------------------------------------------------
def layer_types(cfg) -> list[str]:
    """Per main layer 'mla' or 'kda' (§3): MLA iff (i+1) % group == 0, or i in an incomplete
    trailing group (i >= floor(N/group)*group).  The MTP layer (index N) is MLA, not listed here."""
    n, g = cfg.num_hidden_layers, cfg.layer_group_size
    full = (n // g) * g
    return [MLA if ((i + 1) % g == 0 or i >= full) else KDA for i in range(n)]


def _attn_type(cfg, layer_idx: int) -> str:
    if layer_idx >= cfg.num_hidden_layers:  # MTP layer: MLA (mtp_use_kda = false)
        return MLA
    return layer_types(cfg)[layer_idx]


def _is_moe(cfg, layer_idx: int) -> bool:
    return layer_idx >= cfg.first_k_dense_replace  # the MTP layer (index N) is MoE too


def swiglu_limits(cfg, layer_idx: int, clamp: bool = True) -> tuple[float, float]:
    """(routed, shared) clamp limits of §7.2 for a layer; 0.0 = no clamp; MTP layer unclamped."""
    if not clamp or layer_idx >= cfg.num_hidden_layers:
        return 0.0, 0.0
    er = list(cfg.expert_swiglu_limit_list or [])
    sh = list(cfg.share_expert_swiglu_limit_list or [])
    r = float(er[layer_idx] or 0.0) if layer_idx < len(er) else 0.0
    s = float(sh[layer_idx] or 0.0) if layer_idx < len(sh) else 0.0
    return r, s


# ------------------------------------------------------------------------------------------------
# §5 normalisations
# ------------------------------------------------------------------------------------------------
def rms_norm(x, w, eps):
    """x [..., n], w [n] -> w * x / sqrt(mean(x^2) + eps)."""
    x = _f64(x)
    r = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return _f64(w) * r


def l2_normalize(x, eps=1e-6):
    """x [..., n] -> x / sqrt(sum(x^2) + eps)  (eps inside the sqrt, added to the sum; §5.2)."""
    x = _f64(x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(o, g, w, eps):
    """o, g [..., dv], w [dv]: normalize(o) * w * sigmoid(g)  (§5.3)."""
    return rms_norm(o, w, eps) * sigmoid(g)


# ------------------------------------------------------------------------------------------------
# §7 SwiGLU
# ------------------------------------------------------------------------------------------------
def swiglu(x, wg, wu, wd, limit=0.0):
    """x [T, D], wg/wu [I, D], wd [D, I] -> [T, D].

    limit > 0: ``min(SiLU(gate), limit) * clip(up, -limit, limit)`` (§7.2; clamp after SiLU, gate
    branch from above only)."""
    x = _f64(x)
    gate = silu(x @ _f64(wg).T)
    up = x @ _f64(wu).T
    if limit and limit > 0:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    return (gate * up) @ _f64(wd).T


def dense_mlp(params, prefix, x, limit=0.0):
    """Dense SwiGLU FFN (layers < first_k_dense_replace). prefix 'model.layers.i[.mlp]'; x [T, D]."""
    p = _module_prefix(prefix, "mlp")
    return swiglu(x, _w(params, f"{p}.gate_proj.weight"), _w(params, f"{p}.up_proj.weight"),
                  _w(params, f"{p}.down_proj.weight"), limit)


# ------------------------------------------------------------------------------------------------
# §8 MoE
# ------------------------------------------------------------------------------------------------
def _topk_desc(v: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of a 1-D array, largest first (ties: lower index first)."""
    return np.argsort(-v, kind="stable")[:k]


def router(x, gate_w, expert_bias, cfg, forced_idx=None):
    """Sigmoid grouped no-aux router of §8.1.

    x [T, D] (post-attention RMSNorm output), gate_w [E, D], expert_bias [E] (None = zeros).
    Returns (topk_idx [T, k] int64, topk_weight [T, k] float64).  Indices are ordered by descending
    biased selection score.  ``forced_idx`` [T, k]: skip selection, use these indices; the weights
    are still the unbiased scores at those indices, renormalised, times routed_scaling_factor.
    """
    x = _f64(x)
    E = cfg.num_experts
    k = cfg.num_experts_per_tok
    n_group, topk_group = cfg.n_group, cfg.topk_group
    per_group = E // n_group
    logits = x @ _f64(gate_w).T                                  # [T, E]
    scores = sigmoid(logits)                                     # unbiased s
    bias = np.zeros(E) if expert_bias is None else _f64(expert_bias)
    sel = scores + bias                                          # biased s~ (selection only)
    T = x.shape[0]
    if forced_idx is not None:
        idx = np.asarray(forced_idx, dtype=np.int64).reshape(T, -1)
    else:
        idx = np.zeros((T, k), dtype=np.int64)
        for t in range(T):
            grouped = sel[t].reshape(n_group, per_group)
            top2 = np.sort(grouped, axis=-1)[:, -2:]             # two largest per group
            group_score = top2.sum(axis=-1)                      # [n_group]
            keep = _topk_desc(group_score, topk_group)
            mask = np.full(n_group, -np.inf)
            mask[keep] = 0.0
            masked = (grouped + mask[:, None]).reshape(E)        # -inf outside kept groups
            idx[t] = _topk_desc(masked, k)
    w = np.take_along_axis(scores, idx, axis=1)                  # unbiased scores of the chosen
    if idx.shape[1] > 1 or cfg.norm_topk_prob:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    return idx, w


def moe_layer(params, prefix, x, cfg, layer_idx, forced_idx=None, clamp=True):
    """MoE block of §8 for layer ``layer_idx`` (N = num_hidden_layers for the MTP layer, unclamped).

    x [T, D] -> (out [T, D], topk_idx [T, k]).  Routed limit = expert_swiglu_limit_list[layer],
    shared limit = share_expert_swiglu_limit_list[layer] (only if ``clamp``)."""
    p = _module_prefix(prefix, "mlp")
    x = _f64(x)
    lim_r, lim_s = swiglu_limits(cfg, layer_idx, clamp)
    bias_name = f"{p}.gate.expert_bias"
    idx, w = router(x, _w(params, f"{p}.gate.weight"),
                    _w(params, bias_name) if bias_name in params else None, cfg, forced_idx)
    out = np.zeros_like(x)
    for e in np.unique(idx):
        rows, slots = np.nonzero(idx == e)
        ep = f"{p}.experts.{int(e)}"
        y = swiglu(x[rows], _w(params, f"{ep}.gate_proj.weight"), _w(params, f"{ep}.up_proj.weight"),
                   _w(params, f"{ep}.down_proj.weight"), lim_r)
        np.add.at(out, rows, w[rows, slots][:, None] * y)
    sp = f"{p}.shared_experts"
    if cfg.num_shared_experts > 0 and f"{sp}.gate_proj.weight" in params:
        out = out + swiglu(x, _w(params, f"{sp}.gate_proj.weight"), _w(params, f"{sp}.up_proj.weight"),
                           _w(params, f"{sp}.down_proj.weight"), lim_s)  # not scaled, no gate
    return out, idx


# ------------------------------------------------------------------------------------------------
# §9 Kimi Delta Attention
# ------------------------------------------------------------------------------------------------
def short_conv(u, taps, conv_state=None):
    """Causal depthwise conv + SiLU (§9.2).

    u [T, C] raw projections, taps [C, K] (= conv1d.weight[:, 0, :]; tap K-1 multiplies the current
    token), conv_state [K-1, C] = previous K-1 raw inputs, oldest first (zeros if None).
    Returns (y [T, C], new_state [K-1, C] = last K-1 raw inputs of state ++ u)."""
    u = _f64(u)
    taps = _f64(taps)
    C, K = taps.shape
    T = u.shape[0]
    if conv_state is None:
        conv_state = np.zeros((K - 1, C))
    full = np.concatenate([_f64(conv_state).reshape(K - 1, C), u], axis=0)   # [K-1+T, C]
    y = np.zeros((T, C))
    for t in range(T):
        # full[t + j] is the token (K-1-j) steps before token t
        y[t] = np.sum(taps.T * full[t:t + K], axis=0)
    new_state = full[full.shape[0] - (K - 1):].copy() if K > 1 else np.zeros((0, C))
    return silu(y), new_state


def kda_gate(f, A_log, dt_bias, lower_bound):
    """Bounded log-decay (§9.3).  f [T, H*dk] or [T, H, dk]; A_log [H]; dt_bias [H*dk].
    Returns g [T, H, dk] = L * sigmoid(exp(A_log[h]) * (f + dt_bias)), in (L, 0)."""
    A_log = _f64(A_log)
    H = A_log.shape[0]
    f = _f64(f)
    T = f.shape[0]
    f = f.reshape(T, H, -1)
    dt = _f64(dt_bias).reshape(H, -1)
    return lower_bound * sigmoid(np.exp(A_log)[None, :, None] * (f + dt[None]))


def _kda_prepare_qk(q, k, normalize):
    q, k = _f64(q), _f64(k)
    if normalize:
        dk = q.shape[-1]
        q = l2_normalize(q) / math.sqrt(dk)
        k = l2_normalize(k)
    return q, k


def kda_recurrent(q, k, v, g, beta, state=None, normalize=True):
    """Per-token KDA recurrence (§9.6), all heads at once.

    q, k [T, H, dk]: with ``normalize=True`` (default) the RAW post-conv q, k — this function applies
    the per-head L2 norm (eps 1e-6) and the 1/sqrt(dk) query scale; with ``normalize=False`` q must
    already be l2-normalised and scaled, k l2-normalised.
    v [T, H, dv]; g [T, H, dk] log-decay; beta [T, H]; state [H, dk, dv] (zeros if None).
    Returns (o [T, H, dv], new_state [H, dk, dv])."""
    q, k = _kda_prepare_qk(q, k, normalize)
    v, g, beta = _f64(v), _f64(g), _f64(beta)
    T, H, dk = k.shape
    dv = v.shape[-1]
    S = np.zeros((H, dk, dv)) if state is None else _f64(state).copy()
    o = np.zeros((T, H, dv))
    for t in range(T):
        S = np.exp(g[t])[:, :, None] * S                          # 1. decay rows (key channels)
        e = v[t] - np.einsum("hkv,hk->hv", S, k[t])               # 2. error with decayed state
        S = S + beta[t][:, None, None] * k[t][:, :, None] * e[:, None, :]   # 3. write
        o[t] = np.einsum("hkv,hk->hv", S, q[t])                   # 4. read with updated state
    return o, S


def kda_chunked(q, k, v, g, beta, state=None, chunk=64, normalize=True):
    """Chunked (WY) KDA form of §9.7; same arguments/returns as :func:`kda_recurrent`.
    T need not be a multiple of ``chunk`` (the last chunk is shorter)."""
    q, k = _kda_prepare_qk(q, k, normalize)
    v, g, beta = _f64(v), _f64(g), _f64(beta)
    T, H, dk = k.shape
    dv = v.shape[-1]
    S_all = np.zeros((H, dk, dv)) if state is None else _f64(state).copy()
    o = np.zeros((T, H, dv))
    for start in range(0, T, chunk):
        sl = slice(start, min(start + chunk, T))
        for h in range(H):
            Q, K, V = q[sl, h], k[sl, h], v[sl, h]                # [C, dk], [C, dk], [C, dv]
            b = beta[sl, h]                                       # [C]
            G = np.cumsum(g[sl, h], axis=0)                       # Γ [C, dk]
            C = K.shape[0]
            S0 = S_all[h]
            # decay factor between positions r >= s: D[r, s, d] = exp(Γ_r[d] - Γ_s[d])
            diff = G[:, None, :] - G[None, :, :]
            causal = np.tril(np.ones((C, C), dtype=bool))
            D = np.where(causal[:, :, None], np.exp(np.where(causal[:, :, None], diff, 0.0)), 0.0)
            KK = np.einsum("rd,sd,rsd->rs", K, K, D)
            Lmat = np.tril(b[:, None] * KK, k=-1)                 # 1. strictly lower
            # 2. Tm = (I + Lmat)^-1 Diag(beta) by forward substitution
            Tm = np.zeros((C, C))
            for r in range(C):
                row = np.zeros(C)
                row[r] = b[r]
                row -= Lmat[r, :r] @ Tm[:r]
                Tm[r] = row
            W = Tm @ (np.exp(G) * K)                              # 3.
            U = Tm @ V
            Vt = U - W @ S0                                       # 4. pseudo-values
            A = np.einsum("rd,sd,rsd->rs", Q, K, D)               # 5. diag included, causal
            o[sl, h] = (Q * np.exp(G)) @ S0 + A @ Vt              # 6.
            S_all[h] = np.exp(G[-1])[:, None] * S0 + (np.exp(G[-1][None, :] - G) * K).T @ Vt  # 7.
    return o, S_all


def kda_layer(params, prefix, x, cfg, state=None):
    """Full KDA attention block (§9).  x [T, D] (post input-RMSNorm).

    state: None or {'recurrent': [H, dk, dv], 'conv_q', 'conv_k', 'conv_v': [K-1, H*dk]}.
    Returns (out [T, D], new_state with the same keys)."""
    p = _module_prefix(prefix, "attention")
    x = _f64(x)
    T = x.shape[0]
    H, dk = cfg.num_attention_heads, cfg.head_dim
    dv = dk
    state = state or {}
    new_state = {}
    streams = {}
    for name in ("q", "k", "v"):
        u = x @ _w(params, f"{p}.{name}_proj.weight").T                         # [T, H*d]
        taps = _w(params, f"{p}.{name}_conv1d.weight")
        taps = taps.reshape(taps.shape[0], -1)                                 # [C, K]
        y, new_state[f"conv_{name}"] = short_conv(u, taps, state.get(f"conv_{name}"))
        streams[name] = y.reshape(T, H, -1)
    g = kda_gate(x @ _w(params, f"{p}.f_proj.weight").T, _w(params, f"{p}.A_log"),
                 _w(params, f"{p}.dt_bias"), cfg.kda_lower_bound)               # [T, H, dk]
    beta = sigmoid(x @ _w(params, f"{p}.b_proj.weight").T)                     # [T, H]
    o, new_state["recurrent"] = kda_recurrent(streams["q"], streams["k"], streams["v"], g, beta,
                                              state.get("recurrent"), normalize=True)
    gate = (x @ _w(params, f"{p}.g_proj.weight").T).reshape(T, H, dv)
    y = gated_rms_norm(o, gate, _w(params, f"{p}.o_norm.weight"), cfg.rms_norm_eps)
    out = y.reshape(T, H * dv) @ _w(params, f"{p}.o_proj.weight").T
    return out, new_state


# ------------------------------------------------------------------------------------------------
# §10 MLA
# ------------------------------------------------------------------------------------------------
def _yarn_m(s: float, mu: float) -> float:
    return 1.0 if s <= 1 else 0.1 * mu * math.log(s) + 1.0


def rope_inv_freq(cfg):
    """Returns (inv_freq [rope_dim/2], attention_factor) for the MLA rotary part (§10.2, §10.3).
    Rotary width is always qk_rope_head_dim (partial_rotary_factor / rotary_dim are ignored)."""
    d = cfg.qk_rope_head_dim
    base = float(cfg.rope_theta)
    i = np.arange(d // 2, dtype=F64)
    inv_extra = base ** (-2.0 * i / d)
    rs = cfg.rope_scaling
    if rs is None or _rs_get(rs, "rope_type", "yarn") not in ("yarn",):
        return inv_extra, 1.0
    s = float(_rs_get(rs, "factor"))
    L0 = float(_rs_get(rs, "original_max_position_embeddings", cfg.max_position_embeddings))
    beta_fast = float(_rs_get(rs, "beta_fast", 32.0))
    beta_slow = float(_rs_get(rs, "beta_slow", 1.0))
    truncate = bool(_rs_get(rs, "truncate", True))
    inv_inter = inv_extra / s

    def corr_dim(r):
        return d * math.log(L0 / (2 * math.pi * r)) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi = hi + 0.001
    ramp = np.clip((i - lo) / (hi - lo), 0.0, 1.0)
    omega = 1.0 - ramp                                          # extrapolation weight
    inv_freq = inv_inter * (1.0 - omega) + inv_extra * omega
    af = _rs_get(rs, "attention_factor")
    if af is None:
        ms, msa = _rs_get(rs, "mscale"), _rs_get(rs, "mscale_all_dim")
        if ms and msa:
            af = _yarn_m(s, ms) / _yarn_m(s, msa)
        else:
            af = _yarn_m(s, 1.0)
    return inv_freq, float(af)


def mla_softmax_scale(cfg) -> float:
    """1/sqrt(qk_head_dim), times m(s, mscale_all_dim)^2 under YaRN with mscale_all_dim (§10.3/10.4)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and _rs_get(rs, "rope_type", "yarn") == "yarn":
        msa = _rs_get(rs, "mscale_all_dim")
        if msa:
            scale *= _yarn_m(float(_rs_get(rs, "factor")), float(msa)) ** 2
    return scale


def apply_rope_interleaved(x, positions, inv_freq, attention_factor=1.0):
    """Adjacent-pair rotation in stored order (§10.2).  x [..., T, d], positions [T].
    (x_2i, x_2i+1) -> (a cos - b sin, b cos + a sin), cos/sin scaled by attention_factor."""
    x = _f64(x)
    phi = _f64(positions)[:, None] * _f64(inv_freq)[None, :]    # [T, d/2]
    cos, sin = np.cos(phi) * attention_factor, np.sin(phi) * attention_factor
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def _mla_common(params, p, x, positions, cfg, cache):
    """Shared front part of both MLA forms.  Returns q_nope [T,H,nope], q_pe [T,H,rope] (rotated),
    c_all [S+T, kv_lora], kpe_all [S+T, rope] (rotated), S, gate [T, H], new_cache."""
    H = cfg.num_attention_heads
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    T = x.shape[0]
    if cfg.q_lora_rank is None:
        q = x @ _w(params, f"{p}.q_proj.weight").T
    else:
        cq = rms_norm(x @ _w(params, f"{p}.q_a_proj.weight").T, _w(params, f"{p}.q_a_layernorm.weight"),
                      QK_NORM_EPS)
        q = cq @ _w(params, f"{p}.q_b_proj.weight").T
    q = q.reshape(T, H, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv_a = x @ _w(params, f"{p}.kv_a_proj_with_mqa.weight").T
    r = cfg.kv_lora_rank
    c = rms_norm(kv_a[:, :r], _w(params, f"{p}.kv_a_layernorm.weight"), QK_NORM_EPS)  # [T, r]
    k_pe_raw = kv_a[:, r:]                                                           # [T, rope]
    inv_freq, af = rope_inv_freq(cfg)
    positions = np.asarray(positions)
    q_pe = apply_rope_interleaved(q_pe.transpose(1, 0, 2), positions, inv_freq, af).transpose(1, 0, 2)
    k_pe = apply_rope_interleaved(k_pe_raw, positions, inv_freq, af)
    if cache is None:
        c_prev, kpe_prev = np.zeros((0, r)), np.zeros((0, rope))
    else:
        c_prev, kpe_prev = _f64(cache["c"]), _f64(cache["k_pe"])
    S = c_prev.shape[0]
    c_all = np.concatenate([c_prev, c], axis=0)
    kpe_all = np.concatenate([kpe_prev, k_pe], axis=0)
    gate = sigmoid(x @ _w(params, f"{p}.g_proj.weight").T)                           # [T, H]
    return q_nope, q_pe, c_all, kpe_all, S, gate, {"c": c_all, "k_pe": kpe_all}


def _causal_mask(T: int, S: int) -> np.ndarray:
    """[T, S+T] bool: new token t (absolute slot S+t) sees slots 0..S+t."""
    return np.arange(S + T)[None, :] <= (S + np.arange(T))[:, None]


def mla_layer(params, prefix, x, positions, cfg, cache=None):
    """Gated MLA, expanded form (§10.1, 10.4, 10.5).  x [T, D], positions [T] (absolute).

    cache: None or {'c': [S, kv_lora_rank] normalised latent, 'k_pe': [S, rope] after RoPE} of the
    S earlier tokens (all before the new ones).  Returns (out [T, D], new_cache with S+T rows)."""
    p = _module_prefix(prefix, "attention")
    x = _f64(x)
    T = x.shape[0]
    H, nope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q_nope, q_pe, c_all, kpe_all, S, gate, new_cache = _mla_common(params, p, x, positions, cfg, cache)
    kv = (c_all @ _w(params, f"{p}.kv_b_proj.weight").T).reshape(S + T, H, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]                  # [S+T, H, nope], [S+T, H, vd]
    scores = (np.einsum("thd,shd->hts", q_nope, k_nope)
              + np.einsum("thd,sd->hts", q_pe, kpe_all)) * mla_softmax_scale(cfg)
    scores = np.where(_causal_mask(T, S)[None], scores, -np.inf)
    P = softmax(scores, axis=-1)                                # [H, T, S+T]
    o = np.einsum("hts,shd->thd", P, v)                         # [T, H, vd]
    o = o * gate[:, :, None]
    out = o.reshape(T, H * vd) @ _w(params, f"{p}.dense.weight").T
    return out, new_cache


def mla_layer_absorbed(params, prefix, x, positions, cfg, cache=None):
    """Gated MLA, absorbed form (§10.6): MQA over the latent [c ; k_pe] with per-head q̂ = W_UK^T q_nope
    and o = W_UV ĉ.  Same arguments, cache format and results as :func:`mla_layer`."""
    p = _module_prefix(prefix, "attention")
    x = _f64(x)
    T = x.shape[0]
    H, nope, vd, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_nope, q_pe, c_all, kpe_all, S, gate, new_cache = _mla_common(params, p, x, positions, cfg, cache)
    wkv = _w(params, f"{p}.kv_b_proj.weight").reshape(H, nope + vd, r)
    W_UK, W_UV = wkv[:, :nope, :], wkv[:, nope:, :]             # [H, nope, r], [H, vd, r]
    q_hat = np.einsum("thd,hdr->thr", q_nope, W_UK)             # [T, H, r]
    scores = (np.einsum("thr,sr->hts", q_hat, c_all)
              + np.einsum("thd,sd->hts", q_pe, kpe_all)) * mla_softmax_scale(cfg)
    scores = np.where(_causal_mask(T, S)[None], scores, -np.inf)
    P = softmax(scores, axis=-1)
    c_hat = np.einsum("hts,sr->thr", P, c_all)                  # [T, H, r]
    o = np.einsum("thr,hdr->thd", c_hat, W_UV)                  # [T, H, vd]
    o = o * gate[:, :, None]
    out = o.reshape(T, H * vd) @ _w(params, f"{p}.dense.weight").T
    return out, new_cache


# ------------------------------------------------------------------------------------------------
# §4 decoder layer and full forward, §11 MTP
# ------------------------------------------------------------------------------------------------
def decoder_layer(params, cfg, layer_idx, h, positions, state=None, forced_idx=None, clamp=True,
                  mla_absorbed=False):
    """Pre-norm residual block (§4 step 2) of layer ``layer_idx`` (N = MTP layer: MLA + MoE).

    h [T, D] residual stream, positions [T].  state: the layer's KDA state dict or MLA cache dict.
    Returns (h_out [T, D], new_state, topk_idx [T, k] or None for dense layers)."""
    p = f"model.layers.{layer_idx}"
    eps = cfg.rms_norm_eps
    h = _f64(h)
    xa = rms_norm(h, _w(params, f"{p}.input_layernorm.weight"), eps)
    if _attn_type(cfg, layer_idx) == KDA:
        a, new_state = kda_layer(params, p, xa, cfg, state)
    else:
        fn = mla_layer_absorbed if mla_absorbed else mla_layer
        a, new_state = fn(params, p, xa, positions, cfg, state)
    u = h + a
    xm = rms_norm(u, _w(params, f"{p}.post_attention_layernorm.weight"), eps)
    if _is_moe(cfg, layer_idx):
        f, idx = moe_layer(params, p, xm, cfg, layer_idx, forced_idx, clamp)
    else:
        f, idx = dense_mlp(params, p, xm), None
    return u + f, new_state, idx


def forward(params, cfg, input_ids, positions=None, state=None, mtp=False, forced_routing=None,
            clamp=True, mtp_next_id: Optional[int] = None, mla_absorbed=False):
    """Whole model on one sequence.

    input_ids [T] ints; positions [T] (default: offset + arange(T), offset = tokens already in state).
    state: None or the 'state' returned by a previous call: {'offset': int, 'layers': {layer_idx:
    KDA state dict | MLA cache dict}} (layer N = MTP layer's MLA cache).
    forced_routing: optional {layer_idx: topk_idx [T, k]} pinning the routing of those layers.
    clamp: apply the §7.2 SwiGLU clamp.  mtp_next_id: id following input_ids[-1] for the MTP shift
    (None -> 0 fill, §11).  mla_absorbed: use the absorbed MLA form.

    Returns {'logits' [T, V], 'hidden_normed' [T, D], 'mtp_logits' [T, V] (if mtp),
             'routing' {layer_idx: topk_idx [T, k]}, 'state'}."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    T = ids.shape[0]
    N = cfg.num_hidden_layers
    eps = cfg.rms_norm_eps
    offset = 0 if state is None else int(state.get("offset", 0))
    old_layers = {} if state is None else dict(state.get("layers", {}))
    if positions is None:
        positions = offset + np.arange(T)
    positions = np.asarray(positions).reshape(-1)
    forced_routing = forced_routing or {}

    emb = _w(params, "model.word_embeddings.weight")
    lm_head = _w(params, "lm_head.weight")
    h = emb[ids]
    new_layers: dict[int, Any] = {}
    routing: dict[int, np.ndarray] = {}
    for i in range(N):
        h, new_layers[i], idx = decoder_layer(params, cfg, i, h, positions, old_layers.get(i),
                                              forced_routing.get(i), clamp, mla_absorbed)
        if idx is not None:
            routing[i] = idx
    z = rms_norm(h, _w(params, "model.norm.weight"), eps)
    out = {"logits": z @ lm_head.T, "hidden_normed": z, "routing": routing}

    if mtp:
        p = f"model.layers.{N}"
        nxt = 0 if mtp_next_id is None else int(mtp_next_id)
        ids_shift = np.concatenate([ids[1:], np.array([nxt], dtype=np.int64)])
        e = rms_norm(emb[ids_shift], _w(params, f"{p}.enorm.weight"), eps)
        hz = rms_norm(z, _w(params, f"{p}.hnorm.weight"), eps)
        m = np.concatenate([e, hz], axis=-1) @ _w(params, f"{p}.eh_proj.weight").T
        r, new_layers[N], idx = decoder_layer(params, cfg, N, m, positions, old_layers.get(N),
                                              forced_routing.get(N), clamp, mla_absorbed)
        routing[N] = idx
        rz = rms_norm(r, _w(params, f"{p}.final_layernorm.weight"), eps)
        out["mtp_logits"] = rz @ lm_head.T
    elif N in old_layers:
        new_layers[N] = old_layers[N]
    out["state"] = {"offset": offset + T, "layers": new_layers}
    return out


# ------------------------------------------------------------------------------------------------
# test helpers
# ------------------------------------------------------------------------------------------------
def tiny_config_dict(**overrides) -> dict:
    """A tiny bailing_hybrid config (10 layers, group 4 -> trailing incomplete group, MTP on)."""
    n = 10
    d = {
        "model_type": "bailing_hybrid", "vocab_size": 97, "hidden_size": 64, "num_hidden_layers": n,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "rms_norm_eps": 1e-6, "layer_group_size": 4, "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 1, "short_conv_kernel_size": 4, "kda_lower_bound": -5,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "qk_head_dim": 24, "v_head_dim": 16, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 4096, "num_experts": 8, "num_experts_per_tok": 3,
        "num_shared_experts": 1, "moe_intermediate_size": 24, "moe_shared_expert_intermediate_size": 24,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "expert_swiglu_limit_list": [0.0] * (n - 2) + [0.6, 0.6],
        "share_expert_swiglu_limit_list": [0.0] * (n - 2) + [0.8, 1.0],
        "tie_word_embeddings": False,
    }
    d.update(overrides)
    return d


def tiny_config(**overrides):
    from ling_jax.config import LingConfig
    return LingConfig.from_dict(tiny_config_dict(**overrides))


def random_params(cfg, seed=0) -> dict[str, np.ndarray]:
    """Random float64 parameters with every checkpoint tensor of §12 for ``cfg`` (incl. MTP layer).
    Matrices ~ N(0, 1/fan_in) (KDA f_proj x0.25), norms ~ 1 + N(0, 0.01), A_log = log U(1, 16),
    dt_bias ~ N(0, 0.01), expert_bias ~ N(0, 0.0025), conv taps ~ N(0, 0.25), embeddings ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    H, dk = cfg.num_attention_heads, cfg.head_dim
    P = H * dk
    K = cfg.short_conv_kernel_size
    nope, rope, vd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    p: dict[str, np.ndarray] = {}

    def lin(name, out_dim, in_dim):
        p[name] = rng.standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)

    def norm(name, n):
        p[name] = 1.0 + 0.1 * rng.standard_normal(n)

    p["model.word_embeddings.weight"] = rng.standard_normal((V, D))
    norm("model.norm.weight", D)
    lin("lm_head.weight", V, D)
    n_layers = N + (1 if cfg.num_nextn_predict_layers > 0 else 0)
    for i in range(n_layers):
        pre = f"model.layers.{i}"
        norm(f"{pre}.input_layernorm.weight", D)
        norm(f"{pre}.post_attention_layernorm.weight", D)
        a = f"{pre}.attention"
        if _attn_type(cfg, i) == KDA:
            for nm in ("q", "k", "v", "f", "g"):
                lin(f"{a}.{nm}_proj.weight", P, D)
            p[f"{a}.f_proj.weight"] *= 0.25  # keep the bounded gate away from full saturation
            lin(f"{a}.o_proj.weight", D, P)
            lin(f"{a}.b_proj.weight", H, D)
            for nm in ("q", "k", "v"):
                p[f"{a}.{nm}_conv1d.weight"] = 0.5 * rng.standard_normal((P, 1, K))
            p[f"{a}.A_log"] = np.log(rng.uniform(1.0, 16.0, H))
            p[f"{a}.dt_bias"] = 0.1 * rng.standard_normal(P)
            norm(f"{a}.o_norm.weight", dk)
        else:
            if cfg.q_lora_rank is None:
                lin(f"{a}.q_proj.weight", H * (nope + rope), D)
            else:
                lin(f"{a}.q_a_proj.weight", cfg.q_lora_rank, D)
                norm(f"{a}.q_a_layernorm.weight", cfg.q_lora_rank)
                lin(f"{a}.q_b_proj.weight", H * (nope + rope), cfg.q_lora_rank)
            lin(f"{a}.kv_a_proj_with_mqa.weight", r + rope, D)
            norm(f"{a}.kv_a_layernorm.weight", r)
            lin(f"{a}.kv_b_proj.weight", H * (nope + vd), r)
            lin(f"{a}.g_proj.weight", H, D)
            lin(f"{a}.dense.weight", D, H * vd)
        m = f"{pre}.mlp"
        if _is_moe(cfg, i):
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            lin(f"{m}.gate.weight", E, D)
            p[f"{m}.gate.expert_bias"] = 0.05 * rng.standard_normal(E)
            for e in range(E):
                lin(f"{m}.experts.{e}.gate_proj.weight", I, D)
                lin(f"{m}.experts.{e}.up_proj.weight", I, D)
                lin(f"{m}.experts.{e}.down_proj.weight", D, I)
            if cfg.num_shared_experts > 0:
                Is = cfg.moe_shared_expert_intermediate_size * cfg.num_shared_experts
                lin(f"{m}.shared_experts.gate_proj.weight", Is, D)
                lin(f"{m}.shared_experts.up_proj.weight", Is, D)
                lin(f"{m}.shared_experts.down_proj.weight", D, Is)
        else:
            I = cfg.intermediate_size
            lin(f"{m}.gate_proj.weight", I, D)
            lin(f"{m}.up_proj.weight", I, D)
            lin(f"{m}.down_proj.weight", D, I)
        if i == N:  # MTP-only tensors
            norm(f"{pre}.enorm.weight", D)
            norm(f"{pre}.hnorm.weight", D)
            norm(f"{pre}.final_layernorm.weight", D)
            lin(f"{pre}.eh_proj.weight", D, 2 * D)
    return p
